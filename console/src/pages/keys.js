// API keys: the tenant's own keys (create with the secret shown once, revoke), through
// /v1/organization/projects/{tenant}/api_keys.
import { del, get, post } from "../api.js";
import { alertBox, field, formatTime, h, hide, replace, showError } from "../dom.js";

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

  async function refresh() {
    try {
      const keys = (await get(base)).data;
      replace(
        tableBody,
        keys.length
          ? keys.map((key) =>
              h(
                "tr",
                { dataset: { keyId: key.id } },
                h("td", {}, key.name || "(unnamed)"),
                h("td", {}, h("code", {}, `${key.prefix}…`)),
                h("td", {}, formatTime(key.created_at)),
                h("td", {}, key.expires_at ? formatTime(key.expires_at) : "never"),
                h(
                  "td",
                  {},
                  h("button", { type: "button", class: "danger", onclick: () => revoke(key) }, `Revoke ${key.name || key.id}`),
                ),
              ),
            )
          : h("tr", {}, h("td", { colspan: 5 }, "No keys yet.")),
      );
    } catch (error) {
      showError(box, error);
    }
  }

  async function revoke(key) {
    if (!confirm(`Revoke ${key.name || key.id}? Requests with it will be refused at once.`)) return;
    try {
      await del(`${base}/${encodeURIComponent(key.id)}`);
      hide(secretBox);
      await refresh();
    } catch (error) {
      showError(box, error);
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    hide(box);
    try {
      const created = await post(base, name.value ? { name: name.value } : {});
      name.value = "";
      secretBox.hidden = false;
      replace(
        secretBox,
        h("p", {}, h("strong", {}, "Your new key. "), "Copy it now: it is shown only once."),
        h("code", { class: "key-secret", tabindex: 0 }, created.key),
      );
      await refresh();
    } catch (error) {
      showError(box, error);
    }
  });

  main.append(
    form,
    box,
    secretBox,
    h(
      "table",
      { class: "data", tabindex: 0 },
      h("caption", {}, "Keys of tenant ", who.tenant),
      h("thead", {}, h("tr", {}, ["Name", "Key", "Created", "Expires", "Actions"].map((t) => h("th", { scope: "col" }, t)))),
      tableBody,
    ),
  );
  refresh();
}
