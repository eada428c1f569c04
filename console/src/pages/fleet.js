// Fleet (operators): every engine replica's role, KV occupancy, running and waiting requests,
// prefix-hit rate and speculative acceptance, and the autoscaling target against the replicas
// reporting over the last hour, from /v1/admin/fleet, refreshed every 2 s.
import uPlot from "uplot";
import { get } from "../api.js";
import { alertBox, dataTable, emptyRow, h, poller, replace } from "../dom.js";

const REFRESH_MS = 2000;
const percent = (x) => (typeof x === "number" && isFinite(x) ? `${(100 * x).toFixed(1)}%` : "");

function scalingChart(container, samples, previous) {
  if (previous) previous.destroy();
  replace(container);
  if (!samples.length) {
    container.append(h("figcaption", {}, "No autoscaling history: one engine runs in this process."));
    return null;
  }
  const last = samples[samples.length - 1];
  container.append(
    h(
      "figcaption",
      {},
      `Now ${last.replicas} replicas reporting, target ${last.target ?? "none (no autoscaling)"}; the last hour:`,
    ),
  );
  const data = [samples.map((s) => s.time), samples.map((s) => s.replicas), samples.map((s) => s.target)];
  const stepped = uPlot.paths.stepped({ align: 1 });
  return new uPlot(
    {
      width: Math.max(240, (container.clientWidth || 600) - 16),
      height: 200,
      scales: { x: { time: true }, y: { range: (_u, min, max) => [0, Math.max(1, max) + 1] } },
      axes: [{}, { label: "replicas", size: 60 }],
      series: [
        {},
        { label: "replicas reporting", stroke: "#1f5fbf", width: 2, paths: stepped },
        { label: "target", stroke: "#c2410c", width: 2, dash: [6, 4], paths: stepped },
      ],
    },
    data,
    container,
  );
}

const replicaRow = ([id, r]) =>
  h(
    "tr",
    {},
    h("td", {}, h("code", {}, id)),
    h("td", {}, r.role || "colocated"),
    h(
      "td",
      {},
      h("meter", { min: 0, max: 1, value: r.kv_occupancy || 0, "aria-label": `KV occupancy of ${id}` }),
      " ",
      percent(r.kv_occupancy),
    ),
    h("td", { class: "num" }, r.num_running),
    h("td", { class: "num" }, r.num_waiting),
    h("td", { class: "num" }, percent(r.prefix_cache_hit_rate)),
    h("td", { class: "num" }, percent(r.draft_acceptance_rate)),
  );

export function render(main) {
  const box = alertBox();
  const summary = h("p", { class: "totals", role: "status" });
  const chartBox = h("figure", { class: "chart", "aria-label": "Autoscaling: replicas reporting and the target, last hour" });
  const tableBody = h("tbody");
  let plot = null;
  const polling = poller(
    box,
    async () => {
      const fleet = await get("/v1/admin/fleet");
      const replicas = Object.entries(fleet.replicas).sort(([a], [b]) => a.localeCompare(b));
      const sum = (key) => replicas.reduce((s, [, r]) => s + (r[key] || 0), 0);
      replace(
        summary,
        `${fleet.model}: ${replicas.length} replicas, ${sum("num_running")} running, ${sum("num_waiting")} waiting.`,
      );
      plot = scalingChart(chartBox, fleet.scaling || [], plot);
      replace(tableBody, replicas.length ? replicas.map(replicaRow) : emptyRow(7, "No replica has reported yet."));
    },
    REFRESH_MS,
  );
  main.append(
    box,
    summary,
    chartBox,
    dataTable(
      "Engine replicas",
      ["Replica", "Role", "KV occupancy", "Running", "Waiting", "Prefix hits", "Draft acceptance"],
      tableBody,
    ),
  );
  polling.run();
  return () => {
    polling.stop();
    if (plot) plot.destroy();
  };
}
