// Usage: the tenant's tokens per day or hour by model (adapters are models "<base>:<name>") and by
// real-time vs batch, as a chart and a table, with CSV export; from the usage API
// (/v1/organization/usage/completions, grouped by model and batch).
import uPlot from "uplot";
import { get, query } from "../api.js";
import { alertBox, dataTable, emptyRow, field, formatTime, guarded, h, replace, saveBlob } from "../dom.js";

const RANGES = {
  "7d": { label: "Last 7 days, by day", width: "1d", buckets: 7 },
  "24h": { label: "Last 24 hours, by hour", width: "1h", buckets: 24 },
  "60m": { label: "Last hour, by minute", width: "1m", buckets: 60 },
};
const WIDTH_S = { "1d": 86400, "1h": 3600, "1m": 60 };
const COLOURS = ["#1f5fbf", "#c2410c", "#15803d", "#7e22ce", "#b91c1c", "#0f766e", "#a16207", "#4338ca"];

/** Every bucket of the range, following `next_page`. */
async function fetchBuckets(range) {
  const width = WIDTH_S[range.width];
  const end = Math.ceil(Date.now() / 1000 / width) * width;
  const params = {
    start_time: end - width * range.buckets,
    end_time: end,
    bucket_width: range.width,
    group_by: ["model", "batch"],
    limit: range.buckets,
  };
  const buckets = [];
  for (let page = null; ;) {
    const result = await get(`/v1/organization/usage/completions?${query({ ...params, page })}`);
    buckets.push(...result.data);
    if (!result.has_more || !result.next_page) return buckets;
    page = result.next_page;
  }
}

function rowsOf(buckets) {
  return buckets.flatMap((bucket) =>
    bucket.results.map((r) => ({
      start: bucket.start_time,
      model: r.model,
      kind: r.batch ? "batch" : "real-time",
      requests: r.num_model_requests,
      input: r.input_tokens,
      cached: r.input_cached_tokens,
      output: r.output_tokens,
    })),
  );
}

function csvOf(rows) {
  const quote = (v) => (/[",\n]/.test(String(v)) ? `"${String(v).replaceAll('"', '""')}"` : String(v));
  const header = ["bucket_start_utc", "model", "kind", "requests", "input_tokens", "input_cached_tokens", "output_tokens"];
  const lines = rows.map((r) =>
    [new Date(r.start * 1000).toISOString(), r.model, r.kind, r.requests, r.input, r.cached, r.output].map(quote).join(","),
  );
  return [header.join(","), ...lines].join("\n") + "\n";
}

function chart(container, buckets, rows) {
  const series = [...new Set(rows.map((r) => `${r.model} (${r.kind})`))].sort();
  const xs = buckets.map((b) => b.start_time);
  const data = [xs];
  for (const name of series) {
    data.push(
      buckets.map((b) =>
        rows
          .filter((r) => r.start === b.start_time && `${r.model} (${r.kind})` === name)
          .reduce((sum, r) => sum + r.input + r.output, 0),
      ),
    );
  }
  const width = Math.max(240, (container.clientWidth || 600) - 16); // the figure's padding
  const options = {
    title: "Tokens (input + output) per bucket",
    width,
    height: 260,
    scales: { x: { time: true } },
    axes: [{}, { label: "tokens", size: 70 }],
    series: [
      {},
      ...series.map((name, i) => ({ label: name, stroke: COLOURS[i % COLOURS.length], width: 2, points: { show: true } })),
    ],
  };
  return new uPlot(options, data, container);
}

export function render(main) {
  const box = alertBox();
  const range = h(
    "select",
    { name: "range" },
    Object.entries(RANGES).map(([value, r]) => h("option", { value }, r.label)),
  );
  const exportButton = h("button", { type: "button", disabled: true }, "Export CSV");
  const chartBox = h("figure", { class: "chart", "aria-label": "Tokens per bucket by model and kind" });
  const tableBody = h("tbody");
  const totals = h("p", { class: "totals", role: "status" });
  let rows = [];
  let plot = null;

  const refresh = guarded(box, async () => {
    const buckets = await fetchBuckets(RANGES[range.value]);
    rows = rowsOf(buckets);
    const sum = (key) => rows.reduce((s, r) => s + r[key], 0);
    replace(totals, `${sum("requests")} requests, ${sum("input")} input and ${sum("output")} output tokens in this range.`);
    if (plot) plot.destroy();
    replace(chartBox);
    plot = chart(chartBox, buckets, rows);
    replace(
      tableBody,
      rows.length
        ? rows.map((r) =>
            h(
              "tr",
              {},
              h("td", {}, formatTime(r.start)),
              h("td", {}, r.model),
              h("td", {}, r.kind),
              h("td", { class: "num" }, r.requests),
              h("td", { class: "num" }, r.input),
              h("td", { class: "num" }, r.output),
            ),
          )
        : emptyRow(6, "No usage in this range."),
    );
    exportButton.disabled = rows.length === 0;
  });

  range.addEventListener("change", refresh);
  exportButton.addEventListener("click", () =>
    saveBlob(new Blob([csvOf(rows)], { type: "text/csv" }), `usage-${range.value}.csv`),
  );
  main.append(
    h("div", { class: "card inline" }, field("Range", range), exportButton),
    box,
    totals,
    chartBox,
    dataTable(
      "Usage by bucket, model and kind",
      ["Bucket (UTC)", "Model", "Kind", "Requests", "Input tokens", "Output tokens"],
      tableBody,
    ),
  );
  refresh();
  return () => plot && plot.destroy();
}
