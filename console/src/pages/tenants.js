// Tenants (operators): every tenant's weight and limits (/v1/admin/tenants) beside its current
// load (requests running and waiting in the engines, and 429s of the last hour: /v1/admin/load) and
// its usage today (the usage API grouped by project); refreshed every 5 s.
import { get, query } from "../api.js";
import { alertBox, dataTable, emptyRow, h, poller, replace } from "../dom.js";

const REFRESH_MS = 5000;
const DAY_S = 86400;

function row(tenant, load, used) {
  const limits = Object.entries(tenant.limits || {})
    .filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${k} ${v}`)
    .join(", ");
  const refused = Object.entries(load.refused_last_hour);
  return h(
    "tr",
    {},
    h("td", {}, tenant.id),
    h("td", { class: "num" }, tenant.weight ?? 1),
    h("td", {}, limits || "server defaults"),
    h("td", { class: "num" }, load.running),
    h("td", { class: "num" }, load.waiting),
    h(
      "td",
      { class: "num", title: refused.map(([code, n]) => `${code}: ${n}`).join(", ") || undefined },
      refused.reduce((sum, [, n]) => sum + n, 0),
    ),
    h("td", { class: "num" }, used.num_model_requests),
    h("td", { class: "num" }, used.input_tokens + used.output_tokens),
  );
}

export function render(main) {
  const box = alertBox();
  const tableBody = h("tbody");
  const polling = poller(
    box,
    async () => {
      const start = Math.floor(Date.now() / 1000 / DAY_S) * DAY_S;
      const usageQuery = query({ start_time: start, bucket_width: "1d", group_by: "project_id", limit: 1 });
      const [tenants, load, usage] = await Promise.all([
        get("/v1/admin/tenants"),
        get("/v1/admin/load"),
        get(`/v1/organization/usage/completions?${usageQuery}`).catch(() => ({ data: [] })), // not metered: no usage
      ]);
      const today = {};
      for (const bucket of usage.data) for (const r of bucket.results) today[r.project_id] = r;
      const idle = { running: 0, waiting: 0, refused_last_hour: {} };
      const unused = { num_model_requests: 0, input_tokens: 0, output_tokens: 0 };
      replace(
        tableBody,
        tenants.data.length
          ? tenants.data.map((t) => row(t, load.tenants[t.id] || idle, today[t.id] || unused))
          : emptyRow(8, "No tenants in the directory."),
      );
    },
    REFRESH_MS,
  );
  main.append(
    box,
    dataTable(
      "Tenants: limits, load now, usage today (UTC)",
      ["Tenant", "Weight", "Limits", "Running", "Waiting", "429s (last hour)", "Requests today", "Tokens today"],
      tableBody,
    ),
  );
  polling.run();
  return polling.stop;
}
