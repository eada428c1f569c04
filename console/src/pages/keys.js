// API keys: the tenant's own keys (create with the secret shown once, revoke), through
// /v1/organization/projects/{tenant}/api_keys.
import { del, get, post } from "../api.js";
import { alertBox, dataTable, emptyRow, field, formatTime, guarded, h, hide, onSubmit, replace } from "../dom.js";

export function render(main, { who }) {
  const base = `/v1/organization/projects/${encodeURIComponent(who.tenant)}/api_keys`;
  const box = alertBox();
  const secretBox = h("div", { class: "secret", hidden: true, role: "status" });
  const name = h("input", { type: "text", name: "name", maxlength: 100 });
  const tableBody = h("tbody");
  const form = h(
    "form",
    { class: "card inline", "aria-label": "Create a key" },
    field("Name", name, "Optional: what the key is for."),
    h("button", { type: "submit", class: "primary" }, "Create key"),
  );

  const row = (key) =>
    h(
      "tr",
      { dataset: { keyId: key.id } },
      h("td", {}, key.name || "(unnamed)"),
      h("td", {}, h("code", {}, key.redacted_value)),
      h("td", {}, formatTime(key.created_at)),
      h("td", {}, key.expires_at ? formatTime(key.expires_at) : "never"),
      h("td", {}, h("button", { type: "button", class: "danger", onclick: () => revoke(key) }, `Revoke ${key.name || key.id}`)),
    );

  const refresh = guarded(box, async () => {
    const keys = (await get(base)).data;
    replace(tableBody, keys.length ? keys.map(row) : emptyRow(5, "No keys yet."));
  });

  const revoke = guarded(box, async (key) => {
    if (!confirm(`Revoke ${key.name || key.id}? Requests with it will be refused at once.`)) return;
    await del(`${base}/${encodeURIComponent(key.id)}`);
    hide(secretBox);
    await refresh();
  });

  onSubmit(form, box, async () => {
    const created = await post(base, name.value ? { name: name.value } : {});
    name.value = "";
    secretBox.hidden = false;
    replace(
      secretBox,
      h("p", {}, h("strong", {}, "Your new key. "), "Copy it now: it is shown only once."),
      h("code", { class: "key-secret", tabindex: 0 }, created.key),
    );
    await refresh();
  });

  main.append(
    form,
    box,
    secretBox,
    dataTable(`Keys of tenant ${who.tenant}`, ["Name", "Key", "Created", "Expires", "Actions"], tableBody),
  );
  refresh();
}
