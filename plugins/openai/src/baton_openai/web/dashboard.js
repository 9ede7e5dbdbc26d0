// The engine dashboard: polls GET /ui/stats (behind the API key) once a second (?poll=SECONDS
// sets another period, 0.1 at least) and draws the figures of each engine; GET /ui/info once for
// the model, the plugins and the CPU path.
"use strict";

const POLL_MS = Math.max(100, 1000 * (Number(new URLSearchParams(location.search).get("poll")) || 1));
const engines = new Map(); // engine index -> {section, plots}

// [figure name, label, value -> text]
const FIGURES = [
  ["running", "Running", (e) => e.running],
  ["waiting", "Waiting", (e) => e.waiting],
  ["preemptions", "Preempted (total)", (e) => e.preemptions],
  ["kv_cache_usage", "KV cache used", (e) => formatPercent(e.kv_cache_usage)],
  ["prefix_cache_hit_rate", "Prefix-cache hits", (e) => formatPercent(e.prefix_cache_hit_rate)],
  ["generation_tokens_per_s", "Output tok/s", (e) => formatRate(e.generation_tokens_per_s)],
  ["prompt_tokens_per_s", "Prompt tok/s", (e) => formatRate(e.prompt_tokens_per_s)],
  ["generation_tokens", "Output tokens (total)", (e) => e.generation_tokens],
  ["ttft", "TTFT p50 / p90 / p99", (e) => percentiles(e.ttft_s)],
  ["itl", "ITL p50 / p90 / p99", (e) => percentiles(e.itl_s)],
  ["finished", "Finished: stop / length / abort / error", (e) => finished(e.finished)],
];
const SMALL = new Set(["ttft", "itl", "finished"]);

function percentiles(p) {
  return [p.p50, p.p90, p.p99].map(formatSeconds).join(" / ");
}

function finished(byReason) {
  return ["stop", "length", "abort", "error"].map((r) => byReason[r] || 0).join(" / ");
}

function engineView(index) {
  let view = engines.get(index);
  if (view) return view;
  const section = element("section", "engine");
  section.id = "engine-" + index;
  section.appendChild(element("h2", "", "Engine " + index));
  const figures = element("div", "figures");
  for (const [name, label] of FIGURES) {
    const box = element("div", "figure");
    box.appendChild(element("div", "label", label));
    const value = element("div", SMALL.has(name) ? "value small" : "value", "–");
    value.dataset.figure = name;
    box.appendChild(value);
    figures.appendChild(box);
  }
  section.appendChild(figures);
  const plots = element("div", "plots");
  const plot = (title, series, options) => {
    const box = element("div", "plot");
    box.appendChild(element("h3", "", title));
    const canvas = element("canvas");
    box.appendChild(canvas);
    plots.appendChild(box);
    return new LinePlot(canvas, series, options);
  };
  view = {
    section,
    requests: plot("Requests", [
      { label: "running", color: "#2f6fde" },
      { label: "waiting", color: "#e67e22" },
    ]),
    kv: plot("KV cache used", [{ label: "KV %", color: "#8e44ad" }], {
      max: 100,
      format: (v) => v + " %",
    }),
    tokens: plot("Output tokens / s", [{ label: "tok/s", color: "#2e9d5b" }]),
    latency: plot("TTFT / ITL p90 (ms)", [
      { label: "TTFT", color: "#c0392b" },
      { label: "ITL", color: "#16a085" },
    ]),
  };
  section.appendChild(plots);
  $("engines").appendChild(section);
  engines.set(index, view);
  return view;
}

function $(id) {
  return document.getElementById(id);
}

function ms(seconds) {
  return seconds === null ? null : seconds * 1000;
}

function showStats(stats) {
  $("uptime").textContent = formatDuration(stats.uptime_s);
  $("engine-count").textContent = stats.engines.length;
  $("rejected").textContent = stats.rejected;
  $("window").textContent = Math.round(stats.window_s) + " s";
  $("stats-off").classList.toggle("hidden", stats.stats_enabled);
  for (const e of stats.engines) {
    const view = engineView(e.engine);
    for (const [name, , text] of FIGURES) {
      view.section.querySelector('[data-figure="' + name + '"]').textContent = text(e);
    }
    view.requests.push([e.running, e.waiting]);
    view.kv.push([e.kv_cache_usage * 100]);
    view.tokens.push([e.generation_tokens_per_s]);
    view.latency.push([ms(e.ttft_s.p90), ms(e.itl_s.p90)]);
  }
  $("status").textContent = "updated " + new Date(stats.time * 1000).toLocaleTimeString();
}

function showInfo(info) {
  $("model-name").textContent = info.model;
  $("playground-link").classList.toggle("hidden", !info.playground);
  const facts = [
    ["model", info.model],
    ["architecture", info.architecture],
    ["context (max_model_len)", info.max_model_len],
    ["device", info.device],
    ["dtype", info.dtype + (info.dtype_native ? " (native)" : " (emulated through float32)")],
    ["data-parallel engines", info.data_parallel_size],
    ["CPU", info.cpu.cpu + " (" + info.cpu.arch + "): " + info.cpu.flags.join(" ")],
    ...info.cpu.grants.map((g) => [g.feature, (g.granted ? "granted: " : "not used: ") + g.reason]),
    ["kernel build", "BATON_KERNEL_ISA=" + info.cpu.kernel_isa + " (" + (info.cpu.build_isa.join(" ") || info.cpu.kernels_error) + ")"],
    ...info.cpu.kernels.map((k) => [k.kernel, k.path + " (" + k.why + ")"]),
    ["structured output", info.structured_output ? "available" : "not installed or off"],
    ["tool-call parser", info.tool_call_parser],
    ["baton", info.version + " · baton-plugin-openai " + info.plugin_version],
  ];
  $("facts").replaceChildren();
  for (const [name, value] of facts) {
    $("facts").append(element("dt", "", name), element("dd", "", value));
  }
  const rows = $("plugins");
  rows.replaceChildren();
  for (const p of info.plugins) {
    const tr = element("tr", p.selected ? "selected" : "");
    tr.append(
      element("td", "", p.kind),
      element("td", "", p.name),
      element("td", "", p.distribution + " " + p.version),
      element("td", "settings", p.settings ? JSON.stringify(p.settings) : "")
    );
    rows.appendChild(tr);
  }
  for (const f of info.failed_plugins) {
    const tr = element("tr", "error");
    tr.append(element("td", "", "failed"), element("td", "", f.plugin),
      element("td", "", f.distribution), element("td", "settings", f.error));
    rows.appendChild(tr);
  }
}

async function poll() {
  try {
    const response = await apiFetch("/ui/stats");
    if (!response.ok) throw new Error(await errorText(response));
    showStats(await response.json());
  } catch (e) {
    $("status").textContent = "no figures: " + e.message;
  }
  setTimeout(poll, POLL_MS);
}

async function start() {
  const response = await apiFetch("/ui/info");
  if (response.ok) showInfo(await response.json());
  else $("status").textContent = "no server info: " + (await errorText(response));
  document.body.dataset.ready = "true";
  poll();
}

document.addEventListener("DOMContentLoaded", start);
