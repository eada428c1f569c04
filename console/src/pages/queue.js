// Batch queue (operators): every unfinished batch of every tenant, oldest first, and per tenant its
// batches, lines left and output tokens queued, from /v1/admin/batches; refreshed every 2 s.
import { get } from "../api.js";
import { alertBox, dataTable, emptyRow, formatTime, h, poller, replace } from "../dom.js";

const REFRESH_MS = 2000;

const tenantRow = ([tenant, t]) =>
  h(
    "tr",
    { dataset: { tenant } },
    h("td", {}, tenant),
    h("td", { class: "num" }, t.batches),
    h("td", { class: "num" }, t.lines_left),
    h("td", { class: "num" }, t.output_tokens_queued),
  );

const batchRow = (b) =>
  h(
    "tr",
    { dataset: { batchId: b.id } },
    h("td", {}, h("code", {}, b.id)),
    h("td", {}, b.tenant),
    h("td", {}, b.status),
    h("td", {}, formatTime(b.created_at)),
    h("td", { class: "num" }, `${b.request_counts.completed + b.request_counts.failed} / ${b.request_counts.total}`),
    h("td", { class: "num" }, b.output_tokens_queued),
  );

export function render(main) {
  const box = alertBox();
  const tenantsBody = h("tbody");
  const batchesBody = h("tbody");
  const polling = poller(
    box,
    async () => {
      const queue = await get("/v1/admin/batches");
      const tenants = Object.entries(queue.tenants).sort(([a], [b]) => a.localeCompare(b));
      replace(tenantsBody, tenants.length ? tenants.map(tenantRow) : emptyRow(4, "The queue is empty."));
      replace(batchesBody, queue.data.map(batchRow));
    },
    REFRESH_MS,
  );
  main.append(
    box,
    dataTable("Queued work per tenant", ["Tenant", "Batches", "Lines left", "Output tokens queued"], tenantsBody),
    dataTable(
      "Unfinished batches, oldest first",
      ["Batch", "Tenant", "Status", "Created", "Lines done", "Output tokens queued"],
      batchesBody,
    ),
  );
  polling.run();
  return polling.stop;
}
