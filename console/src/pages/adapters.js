// Adapters: the tenant's LoRA adapters (list, upload a PEFT folder's two files, delete), through
// /v1/adapters. Validation errors come from the server and are shown beside the form.
import { call, del, get } from "../api.js";
import { alertBox, field, formatTime, h, hide, replace, showError, showNotice } from "../dom.js";

export function render(main) {
  const box = alertBox();
  const name = h("input", { type: "text", name: "name", required: true, pattern: "[A-Za-z0-9._-]+", maxlength: 64 });
  const config = h("input", { type: "file", name: "adapter_config", accept: ".json,application/json", required: true });
  const weights = h("input", { type: "file", name: "adapter_model", accept: ".safetensors", required: true });
  const tableBody = h("tbody");
  const form = h(
    "form",
    { class: "card", "aria-label": "Upload an adapter" },
    h("h2", {}, "Upload an adapter"),
    field("Name", name, "Letters, digits, dot, dash, underscore. Requests name it as model \"<base>:<name>\"."),
    field("adapter_config.json", config),
    field("adapter_model.safetensors", weights, "Safetensors only; checked against the served model before it is stored."),
    box,
    h("button", { type: "submit", class: "primary" }, "Upload"),
  );

  async function refresh() {
    try {
      const adapters = (await get("/v1/adapters")).data;
      replace(
        tableBody,
        adapters.length
          ? adapters.map((adapter) =>
              h(
                "tr",
                { dataset: { adapter: adapter.id } },
                h("td", {}, adapter.id),
                h("td", {}, h("code", {}, adapter.model)),
                h("td", {}, adapter.rank),
                h("td", {}, formatTime(adapter.created_at)),
                h(
                  "td",
                  {},
                  h(
                    "button",
                    { type: "button", class: "danger", onclick: () => remove(adapter.id) },
                    `Delete ${adapter.id}`,
                  ),
                ),
              ),
            )
          : h("tr", {}, h("td", { colspan: 5 }, "No adapters yet.")),
      );
    } catch (error) {
      showError(box, error);
    }
  }

  async function remove(adapterName) {
    if (!confirm(`Delete adapter ${adapterName}?`)) return;
    try {
      await del(`/v1/adapters/${encodeURIComponent(adapterName)}`);
      await refresh();
    } catch (error) {
      showError(box, error);
    }
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    hide(box);
    const body = new FormData();
    body.append("name", name.value);
    body.append("adapter_config", config.files[0], "adapter_config.json");
    body.append("adapter_model", weights.files[0], "adapter_model.safetensors");
    try {
      const created = await call("POST", "/v1/adapters", body);
      showNotice(box, `Adapter ${created.id} uploaded: use it as model ${created.model}.`);
      form.reset();
      await refresh();
    } catch (error) {
      showError(box, error);
    }
  });

  main.append(
    form,
    h(
      "table",
      { class: "data", tabindex: 0 },
      h("caption", {}, "Your adapters"),
      h("thead", {}, h("tr", {}, ["Name", "Model", "Rank", "Uploaded", "Actions"].map((t) => h("th", { scope: "col" }, t)))),
      tableBody,
    ),
  );
  refresh();
}
