// Tenants (operators): every tenant's weight and limits (/v1/admin/tenants) beside its current
// load (requests running and waiting in the engines, and 429s of the last hour: /v1/admin/load) and
// its usage today (the usage API grouped by project); refreshed every 5 s.
import { get, query } from "../api.js";
import { alertBox, h, replace, showError } from "../dom.js";

const REFRESH_MS = 5000;

export function render(main) {
  const box = alertBox();
  const tableBody = h("tbody");
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const day = 86400;
      const start = Math.floor(Date.now() / 1000 / day) * day;
      const [tenants, load, usage] = await Promise.all([
        get("/v1/admin/tenants"),
        get("/v1/admin/load"),
        get(`/v1/organization/usage/completions?${query({ start_time: start, bucket_width: "1d", group_by: "project_id", limit: 1 })}`).catch(
          () => ({ data: [] }),
        ),
      ]);
      const today = {};
      for (const bucket of usage.data) for (const r of bucket.results) today[r.project_id] = r;
      replace(
        tableBody,
        tenants.data.length
          ? tenants.data.map((t) => {
              const used = today[t.id] || { num_model_requests: 0, input_tokens: 0, output_tokens: 0 };
              const now = load.tenants[t.id] || { running: 0, waiting: 0, refused_last_hour: {} };
              const refused = Object.entries(now.refused_last_hour);
              const total429 = refused.reduce((s, [, n]) => s + n, 0);
              const limits = Object.entries(t.limits || {})
                .filter(([, v]) => v !== null && v !== undefined)
                .map(([k, v]) => `${k} ${v}`)
                .join(", ");
              return h(
                "tr",
                {},
                h("td", {}, t.id),
                h("td", { class: "num" }, t.weight ?? 1),
                h("td", {}, limits || "server defaults"),
                h("td", { class: "num" }, now.running),
                h("td", { class: "num" }, now.waiting),
                h("td", { class: "num", title: refused.map(([code, n]) => `${code}: ${n}`).join(", ") || undefined }, total429),
                h("td", { class: "num" }, used.num_model_requests),
                h("td", { class: "num" }, used.input_tokens + used.output_tokens),
              );
            })
          : h("tr", {}, h("td", { colspan: 8 }, "No tenants in the directory.")),
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
      h("caption", {}, "Tenants: limits, load now, usage today (UTC)"),
      h("thead", {}, h("tr", {}, ["Tenant", "Weight", "Limits", "Running", "Waiting", "429s (last hour)", "Requests today", "Tokens today"].map((t) => h("th", { scope: "col" }, t)))),
      tableBody,
    ),
  );
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
