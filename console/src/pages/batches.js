// Batches: the tenant's batch jobs (status, a progress bar with lines done and failed, an ETA,
// downloads of the output and error files, cancel) and a form that uploads a JSONL file and
// starts a batch on it, through /v1/files and /v1/batches. Refreshes every second while a batch
// is not finished.
import { call, get, post } from "../api.js";
import {
  alertBox,
  dataTable,
  emptyRow,
  field,
  formatDuration,
  formatTime,
  guarded,
  h,
  onSubmit,
  poller,
  replace,
  saveBlob,
  showError,
  showNotice,
} from "../dom.js";

const FINAL = new Set(["completed", "failed", "expired", "cancelled"]);
const REFRESH_MS = 1000;

function progress(batch) {
  const counts = batch.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  const label = `${done} of ${counts.total} lines done (${counts.failed} failed)`;
  let eta = "";
  if (!FINAL.has(batch.status) && batch.in_progress_at && done > 0 && counts.total > done) {
    const elapsed = Date.now() / 1000 - batch.in_progress_at;
    eta = `, about ${formatDuration((elapsed / done) * (counts.total - done))} left`;
  }
  return h(
    "div",
    { class: "progress" },
    h("progress", { max: counts.total || 1, value: done, "aria-label": `Progress of ${batch.id}` }),
    h("span", { class: "counts" }, label + eta),
  );
}

async function download(fileId, name, box) {
  try {
    const response = await call("GET", `/v1/files/${encodeURIComponent(fileId)}/content`, undefined, { raw: true });
    saveBlob(await response.blob(), name);
  } catch (error) {
    showError(box, error);
  }
}

export function render(main) {
  const box = alertBox();
  const file = h("input", { type: "file", name: "file", accept: ".jsonl,application/jsonl", required: true });
  const endpoint = h(
    "select",
    { name: "endpoint" },
    h("option", { value: "/v1/chat/completions" }, "/v1/chat/completions"),
    h("option", { value: "/v1/completions" }, "/v1/completions"),
  );
  const form = h(
    "form",
    { class: "card", "aria-label": "Start a batch" },
    h("h2", {}, "Start a batch"),
    field("Requests (JSONL)", file, 'One request per line: {"custom_id", "method": "POST", "url", "body"}.'),
    field("Endpoint", endpoint),
    h("button", { type: "submit", class: "primary" }, "Upload and start"),
  );
  const tableBody = h("tbody");

  const cancel = guarded(box, async (batch) => {
    if (!confirm(`Cancel ${batch.id}? Lines already done keep their results.`)) return;
    await post(`/v1/batches/${encodeURIComponent(batch.id)}/cancel`);
    polling.run();
  });

  function row(batch) {
    const actions = [];
    if (batch.output_file_id)
      actions.push(
        h(
          "button",
          { type: "button", onclick: () => download(batch.output_file_id, `${batch.id}-output.jsonl`, box) },
          "Download output",
        ),
      );
    if (batch.error_file_id)
      actions.push(
        h(
          "button",
          { type: "button", onclick: () => download(batch.error_file_id, `${batch.id}-errors.jsonl`, box) },
          "Download errors",
        ),
      );
    if (!FINAL.has(batch.status) && batch.status !== "cancelling")
      actions.push(h("button", { type: "button", class: "danger", onclick: () => cancel(batch) }, "Cancel"));
    return h(
      "tr",
      { dataset: { batchId: batch.id, status: batch.status } },
      h("td", {}, h("code", {}, batch.id)),
      h("td", {}, formatTime(batch.created_at)),
      h("td", {}, h("span", { class: `status status-${batch.status}` }, batch.status)),
      h("td", {}, progress(batch)),
      h("td", { class: "actions" }, actions),
    );
  }

  // Refreshed every second while a batch is not final.
  const polling = poller(
    box,
    async () => {
      const batches = (await get("/v1/batches?limit=100")).data;
      replace(tableBody, batches.length ? batches.map(row) : emptyRow(5, "No batches yet."));
      return batches.some((b) => !FINAL.has(b.status));
    },
    REFRESH_MS,
  );

  onSubmit(form, box, async () => {
    const upload = new FormData();
    upload.append("purpose", "batch");
    upload.append("file", file.files[0], file.files[0].name);
    const uploaded = await call("POST", "/v1/files", upload);
    const batch = await post("/v1/batches", { input_file_id: uploaded.id, endpoint: endpoint.value, completion_window: "24h" });
    showNotice(box, `Batch ${batch.id} started.`);
    form.reset();
    polling.run();
  });

  main.append(
    form,
    box,
    dataTable("Your batches, newest first", ["Batch", "Created", "Status", "Progress", "Actions"], tableBody),
  );
  polling.run();
  return polling.stop;
}
