// Adapters: the tenant's LoRA adapters (list, upload a PEFT folder's two files, delete), through
// /v1/adapters. Validation errors come from the server and are shown beside the form.
import { call, del, get } from "../api.js";
import { alertBox, dataTable, emptyRow, field, formatTime, guarded, h, onSubmit, replace, showNotice } from "../dom.js";

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
    field("Name", name, 'Letters, digits, dot, dash, underscore. Requests name it as model "<base>:<name>".'),
    field("adapter_config.json", config),
    field("adapter_model.safetensors", weights, "Safetensors only; checked against the served model before it is stored."),
    box,
    h("button", { type: "submit", class: "primary" }, "Upload"),
  );

  const row = (adapter) =>
    h(
      "tr",
      { dataset: { adapter: adapter.id } },
      h("td", {}, adapter.id),
      h("td", {}, h("code", {}, adapter.model)),
      h("td", {}, adapter.rank),
      h("td", {}, formatTime(adapter.created_at)),
      h("td", {}, h("button", { type: "button", class: "danger", onclick: () => remove(adapter.id) }, `Delete ${adapter.id}`)),
    );

  const refresh = guarded(box, async () => {
    const adapters = (await get("/v1/adapters")).data;
    replace(tableBody, adapters.length ? adapters.map(row) : emptyRow(5, "No adapters yet."));
  });

  const remove = guarded(box, async (adapterName) => {
    if (!confirm(`Delete adapter ${adapterName}?`)) return;
    await del(`/v1/adapters/${encodeURIComponent(adapterName)}`);
    await refresh();
  });

  onSubmit(form, box, async () => {
    const body = new FormData();
    body.append("name", name.value);
    body.append("adapter_config", config.files[0], "adapter_config.json");
    body.append("adapter_model", weights.files[0], "adapter_model.safetensors");
    const created = await call("POST", "/v1/adapters", body);
    showNotice(box, `Adapter ${created.id} uploaded: use it as model ${created.model}.`);
    form.reset();
    await refresh();
  });

  main.append(form, dataTable("Your adapters", ["Name", "Model", "Rank", "Uploaded", "Actions"], tableBody));
  refresh();
}
