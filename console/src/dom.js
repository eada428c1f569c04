// A small DOM builder: text always goes in as text (never parsed as HTML), so nothing an API
// returns can inject markup or script.

/** h("button", {class: "x", onclick: f}, "Label", child, ...) -> an element. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace an element's children. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

let uid = 0;
/** A unique id for label/control pairs. */
export function nextId(prefix) {
  uid += 1;
  return `${prefix}-${uid}`;
}

/** A labelled form control: {label, control} where control gets the id the label points to. */
export function field(labelText, control, hint) {
  const id = control.id || nextId("field");
  control.id = id;
  const hintEl = hint ? h("p", { class: "hint", id: `${id}-hint` }, hint) : null;
  if (hintEl) control.setAttribute("aria-describedby", hintEl.id);
  return h("div", { class: "field" }, h("label", { for: id }, labelText), control, hintEl);
}

/** An inline error or notice region, announced to screen readers. */
export function alertBox() {
  return h("div", { class: "alert", role: "alert", hidden: true });
}

export function showError(box, error) {
  box.hidden = false;
  box.className = "alert error";
  replace(box, error.param ? `${error.message} (${error.param})` : error.message);
}

export function showNotice(box, text) {
  box.hidden = false;
  box.className = "alert notice";
  replace(box, text);
}

export function hide(box) {
  box.hidden = true;
  box.replaceChildren();
}

export function formatTime(seconds) {
  if (!seconds) return "";
  return new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 16) + " UTC";
}

export function formatDuration(seconds) {
  if (!isFinite(seconds) || seconds < 0) return "";
  if (seconds < 60) return `${Math.round(seconds)} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

/** Save `blob` as a file named `name` (a download the browser asks nothing for). */
export function saveBlob(blob, name) {
  const url = URL.createObjectURL(blob);
  const link = h("a", { href: url, download: name, hidden: true });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

/** A data table: caption, column headers, and the body the page fills (focusable: it may scroll). */
export function dataTable(caption, headers, body) {
  return h(
    "table",
    { class: "data", tabindex: 0 },
    h("caption", {}, caption),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        headers.map((text) => h("th", { scope: "col" }, text)),
      ),
    ),
    body,
  );
}

/** A body row of one cell spanning `columns`: what an empty table says. */
export function emptyRow(columns, text) {
  return h("tr", {}, h("td", { colspan: columns }, text));
}

/** `action` with its errors shown in `box` (an API error's message and param). */
export function guarded(box, action) {
  return async (...args) => {
    try {
      await action(...args);
    } catch (error) {
      showError(box, error);
    }
  };
}

/** On submit: no page load, the box cleared, `action` run with its errors shown in the box. */
export function onSubmit(form, box, action) {
  const run = guarded(box, action);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    hide(box);
    run();
  });
}

/** Runs `step` now and again every `everyMs` after it finishes, while it returns anything but
 * false and until `stop()` (a page's cleanup); an error shown in `box` ends the polling. */
export function poller(box, step, everyMs) {
  let timer = null;
  let stopped = false;
  async function run() {
    clearTimeout(timer);
    try {
      if ((await step()) !== false && !stopped) timer = setTimeout(run, everyMs);
    } catch (error) {
      showError(box, error);
    }
  }
  return {
    run,
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
  };
}
