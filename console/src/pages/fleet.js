// Fleet (operators): every engine replica's KV occupancy, running and waiting requests,
// prefix-hit rate and speculative acceptance, from /v1/admin/fleet, refreshed every 2 s.
import { get } from "../api.js";
import { alertBox, h, replace, showError } from "../dom.js";

const REFRESH_MS = 2000;
const percent = (x) => (typeof x === "number" && isFinite(x) ? `${(100 * x).toFixed(1)}%` : "");

export function render(main) {
  const box = alertBox();
  const summary = h("p", { class: "totals", role: "status" });
  const tableBody = h("tbody");
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const fleet = await get("/v1/admin/fleet");
      const replicas = Object.entries(fleet.replicas).sort(([a], [b]) => a.localeCompare(b));
      const sum = (key) => replicas.reduce((s, [, r]) => s + (r[key] || 0), 0);
      replace(summary, `${fleet.model}: ${replicas.length} replicas, ${sum("num_running")} running, ${sum("num_waiting")} waiting.`);
      replace(
        tableBody,
        replicas.length
          ? replicas.map(([id, r]) =>
              h(
                "tr",
                {},
                h("td", {}, h("code", {}, id)),
                h("td", {}, r.role || "mixed"),
                h("td", {}, h("meter", { min: 0, max: 1, value: r.kv_occupancy || 0, "aria-label": `KV occupancy of ${id}` }), " ", percent(r.kv_occupancy)),
                h("td", { class: "num" }, r.num_running),
                h("td", { class: "num" }, r.num_waiting),
                h("td", { class: "num" }, percent(r.prefix_cache_hit_rate)),
                h("td", { class: "num" }, percent(r.draft_acceptance_rate)),
              ),
            )
          : h("tr", {}, h("td", { colspan: 7 }, "No replica has reported yet.")),
      );
      if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
    } catch (error) {
      showError(box, error);
    }
  }

  main.append(
    box,
    summary,
    h(
      "table",
      { class: "data", tabindex: 0 },
      h("caption", {}, "Engine replicas"),
      h(
        "thead",
        {},
        h("tr", {}, ["Replica", "Role", "KV occupancy", "Running", "Waiting", "Prefix hits", "Draft acceptance"].map((t) => h("th", { scope: "col" }, t))),
      ),
      tableBody,
    ),
  );
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
