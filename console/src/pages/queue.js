// Batch queue (operators): every unfinished batch of every tenant, oldest first, and per tenant its
// batches, lines left and output tokens queued, from /v1/admin/batches; refreshed every 2 s.
import { get } from "../api.js";
import { alertBox, formatTime, h, replace, showError } from "../dom.js";

const REFRESH_MS = 2000;

export function render(main) {
  const box = alertBox();
  const tenantsBody = h("tbody");
  const batchesBody = h("tbody");
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const queue = await get("/v1/admin/batches");
      const tenants = Object.entries(queue.tenants).sort(([a], [b]) => a.localeCompare(b));
      replace(
        tenantsBody,
        tenants.length
          ? tenants.map(([tenant, t]) =>
              h(
                "tr",
                { dataset: { tenant } },
                h("td", {}, tenant),
                h("td", { class: "num" }, t.batches),
                h("td", { class: "num" }, t.lines_left),
                h("td", { class: "num" }, t.output_tokens_queued),
              ),
            )
          : h("tr", {}, h("td", { colspan: 4 }, "The queue is empty.")),
      );
      replace(
        batchesBody,
        queue.data.map((b) => {
          const counts = b.request_counts;
          return h(
            "tr",
            { dataset: { batchId: b.id } },
            h("td", {}, h("code", {}, b.id)),
            h("td", {}, b.tenant),
            h("td", {}, b.status),
            h("td", {}, formatTime(b.created_at)),
            h("td", { class: "num" }, `${counts.completed + counts.failed} / ${counts.total}`),
            h("td", { class: "num" }, b.output_tokens_queued),
          );
        }),
      );
      if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
    } catch (error) {
      showError(box, error);
    }
  }

  main.append(
    box,
    h(
      "table",
      { class: "data", tabindex: 0 },
      h("caption", {}, "Queued work per tenant"),
      h("thead", {}, h("tr", {}, ["Tenant", "Batches", "Lines left", "Output tokens queued"].map((t) => h("th", { scope: "col" }, t)))),
      tenantsBody,
    ),
    h(
      "table",
      { class: "data", tabindex: 0 },
      h("caption", {}, "Unfinished batches, oldest first"),
      h(
        "thead",
        {},
        h("tr", {}, ["Batch", "Tenant", "Status", "Created", "Lines done", "Output tokens queued"].map((t) => h("th", { scope: "col" }, t))),
      ),
      batchesBody,
    ),
  );
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
