"""The live run page that ``wanexp-status DIR --serve`` serves at ``/``: one self-contained HTML file (no outside
script, font or style; the machines it runs on are often offline) that polls the JSON API (wanexp.cli.status_server)
and draws, per run, step of total, progress, ETA, elapsed, per-GPU memory and utilisation, the loss and lr curves
(inline SVG), val/loss, the validation videos labelled by step and prompt, the pictures and the rejects; per sweep,
its table and rank x lr heatmap.

Every value on it comes from the API as a number and is formatted here (``fmt``: 4 significant digits; ``hms``:
h:mm:ss). Elements tests read: ``[data-run=NAME]`` (the run's card, and its row in the overview), inside it
``[data-field=step|total|state|loss|val_loss|lr|eta|elapsed|progress]``, ``svg[data-chart=loss|lr]`` with
``polyline[data-series]`` (``data-n``: its points), ``figure.video`` (``data-step``, ``data-prompt``),
``[data-sweep=NAME]`` with ``svg[data-chart=heatmap]``.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>wanexp runs</title>
<style>
  :root { --fg:#1d2330; --mute:#6b7385; --line:#dde1e8; --bg:#f5f6f8; --card:#fff; --acc:#2f6fde; --ok:#1a9850;
          --bad:#d73027; --warn:#e69b00; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
         background: var(--bg); }
  header { display: flex; gap: 1.5em; align-items: baseline; padding: .8em 1.2em; background: #1d2330; color: #fff; }
  header h1 { font-size: 18px; margin: 0; }
  header .root { color: #aab3c5; font-family: ui-monospace, monospace; font-size: 12px; }
  header .conn { margin-left: auto; font-size: 12px; color: #aab3c5; }
  header .conn.down { color: #ff8a80; }
  main { padding: 1em 1.2em; display: flex; flex-direction: column; gap: 1em; }
  section.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: .9em 1.1em; }
  h2 { font-size: 16px; margin: 0 0 .5em; display: flex; gap: .6em; align-items: center; flex-wrap: wrap; }
  h2 .sub { color: var(--mute); font-weight: normal; font-size: 13px; }
  h3 { font-size: 13px; margin: 1em 0 .4em; color: var(--mute); text-transform: uppercase; letter-spacing: .04em; }
  table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
  th, td { text-align: left; padding: .25em .7em .25em 0; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { color: var(--mute); font-weight: 600; font-size: 12px; }
  tr.click { cursor: pointer; } tr.click:hover { background: #f0f4fc; }
  tr.open td:first-child { font-weight: 600; }
  tr.best td { font-weight: 700; }
  .state { display: inline-block; padding: .05em .55em; border-radius: 9px; font-size: 12px; color: #fff;
           background: var(--mute); }
  .state.running { background: var(--acc); } .state.finished { background: var(--ok); }
  .state.failed, .state.dead, .state.refused { background: var(--bad); }
  .state.interrupted, .state.stale { background: var(--warn); }
  .bar { position: relative; height: 18px; background: #e9ecf2; border-radius: 4px; overflow: hidden;
         min-width: 120px; }
  .bar > div { position: absolute; inset: 0 auto 0 0; background: var(--acc); }
  .bar.done > div { background: var(--ok); }
  .bar > span { position: relative; padding: 0 .5em; font-size: 12px; line-height: 18px; }
  td .bar { min-width: 190px; }
  .big.bar { height: 24px; } .big.bar > span { line-height: 24px; font-size: 13px; font-weight: 600; }
  .stats { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: .4em 1em; margin: .7em 0; }
  .stats div { display: flex; flex-direction: column; }
  .stats label { color: var(--mute); font-size: 11px; text-transform: uppercase; letter-spacing: .04em; }
  .stats b { font-size: 15px; font-variant-numeric: tabular-nums; }
  .error { color: var(--bad); white-space: pre-wrap; }
  .charts { display: flex; flex-wrap: wrap; gap: 1em; }
  svg.chart { background: #fff; border: 1px solid var(--line); border-radius: 6px; }
  svg text { font: 11px system-ui, sans-serif; fill: var(--mute); }
  svg .title { font-weight: 600; fill: var(--fg); font-size: 12px; }
  .videos { display: flex; flex-wrap: wrap; gap: .8em; }
  figure.video { margin: 0; width: 260px; }
  figure.video video { width: 260px; background: #000; border-radius: 4px; }
  figcaption { font-size: 12px; color: var(--fg); } figcaption .mute { color: var(--mute); }
  .pictures img { max-width: 100%; border: 1px solid var(--line); border-radius: 4px; }
  .mute { color: var(--mute); }
  details summary { cursor: pointer; }
  .empty { color: var(--mute); font-style: italic; }
</style>
</head>
<body>
<header><h1>wanexp runs</h1><span class="root" id="root"></span><span class="conn" id="conn">loading...</span></header>
<main>
  <section class="card" id="overview"><h2>Runs</h2><div id="runs" class="empty">loading...</div></section>
  <div id="sweeps"></div>
  <div id="cards"></div>
</main>
<noscript>This page needs JavaScript; the same data is at /api/runs.</noscript>
<script>
"use strict";
const TOKEN = new URLSearchParams(location.search).get("token");
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fde", "#e4572e", "#17a398", "#9b5de5", "#f3a712", "#555b6e", "#d81159", "#29335c",
                "#6a994e", "#bc4749"];
let EVERY = 2, NOW = Date.now() / 1000;
const expanded = new Set(), seen = new Set(), details = {};

function withToken(u) {
  return TOKEN ? u + (u.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN) : u;
}
async function getJSON(u) {
  const r = await fetch(withToken(u), {cache: "no-store"});
  if (!r.ok) throw new Error(u + ": HTTP " + r.status);
  return r.json();
}
function build(ns, tag, attrs, kids) {
  const el = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const kid of kids.flat(9)) {
    if (kid == null || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}
const h = (tag, attrs, ...kids) => build(null, tag, attrs, kids);
const s = (tag, attrs, ...kids) => build(SVGNS, tag, attrs, kids);

function fmt(v, digits) {
  if (v == null || v === "") return "-";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  return String(Number(v.toPrecision(digits || 4)));
}
function hms(sec) {
  if (sec == null) return "-";
  sec = Math.floor(sec);
  const hh = Math.floor(sec / 3600), mm = Math.floor(sec % 3600 / 60), ss = sec % 60;
  return hh + ":" + String(mm).padStart(2, "0") + ":" + String(ss).padStart(2, "0");
}
function stateBadge(state) { return h("span", {class: "state " + state, "data-field": "state"}, state); }
function progressBar(step, total, state, big) {
  const frac = step != null && total ? Math.min(1, step / total) : 0;
  const text = (step == null ? "-" : step) + " / " + (total == null ? "-" : total) +
               (total ? " (" + (100 * frac).toFixed(1) + " %)" : "");
  return h("div", {class: "bar" + (big ? " big" : "") + (state === "finished" ? " done" : ""),
                   "data-field": "progress", "data-value": frac},
           h("div", {style: "width:" + (100 * frac).toFixed(2) + "%"}), h("span", {}, text));
}
// Rebuilds a part of the page only when its data changed: a playing video or an open <details> stays as it is.
function section(parent, key, data, make) {
  let box = parent.querySelector(":scope > [data-part='" + key + "']");
  if (!box) { box = h("div", {"data-part": key}); parent.append(box); }
  const sig = JSON.stringify(data);
  if (box.dataset.sig === sig) return;
  box.dataset.sig = sig;
  box.replaceChildren(...[make(data)].flat(9).filter(x => x != null));
}

// ---- charts ------------------------------------------------------------------------------------------------------
function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / n, p = Math.pow(10, Math.floor(Math.log10(raw))), e = raw / p;
  const step = p * (e >= 7.5 ? 10 : e >= 3.5 ? 5 : e >= 1.5 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}
function chart(name, title, series, opts) {
  opts = opts || {};
  const W = opts.width || 460, H = opts.height || 220, L = 58, R = 12, T = 24, B = 34;
  const pts = series.flatMap(sr => sr.points);
  const svg = s("svg", {class: "chart", "data-chart": name, width: W, height: H, viewBox: "0 0 " + W + " " + H},
                s("text", {class: "title", x: L, y: 15}, title));
  if (!pts.length) {
    svg.append(s("text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, "nothing logged yet"));
    return svg;
  }
  let x0 = Math.min(...pts.map(p => p[0])), x1 = Math.max(...pts.map(p => p[0]));
  let y0 = Math.min(...pts.map(p => p[1])), y1 = Math.max(...pts.map(p => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { const d = Math.abs(y0) * 0.05 || 1; y0 -= d; y1 += d; }
  const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - R), Y = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  for (const t of niceTicks(y0, y1, 4)) {
    svg.append(s("line", {x1: L, x2: W - R, y1: Y(t), y2: Y(t), stroke: "#eceef2"}),
               s("text", {x: L - 6, y: Y(t) + 4, "text-anchor": "end"}, fmt(t, 3)));
  }
  for (const t of niceTicks(x0, x1, 5).filter(t => t >= x0 && t <= x1 && Number.isInteger(t))) {
    svg.append(s("line", {x1: X(t), x2: X(t), y1: H - B, y2: H - B + 4, stroke: "#999"}),
               s("text", {x: X(t), y: H - B + 16, "text-anchor": "middle"}, fmt(t)));
  }
  svg.append(s("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#999"}),
             s("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle"}, opts.xlabel || "optimizer step"));
  series.forEach((sr, i) => {
    const color = sr.color || COLORS[i % COLORS.length];
    if (!sr.points.length) return;
    const line = s("polyline", {fill: "none", stroke: color, "stroke-width": 1.8, "data-series": sr.name,
                                "data-n": sr.points.length,
                                points: sr.points.map(p => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ")});
    svg.append(line);
    if (sr.points.length <= 40 || sr.dots) {
      for (const p of sr.points) {
        svg.append(s("circle", {cx: X(p[0]), cy: Y(p[1]), r: sr.dots ? 3.5 : 2.2, fill: color},
                     s("title", {}, sr.name + " at step " + p[0] + ": " + fmt(p[1]))));
      }
    }
    svg.append(s("rect", {x: W - R - 150, y: 8 + 14 * i, width: 10, height: 3, fill: color}),
               s("text", {x: W - R - 136, y: 13 + 14 * i}, sr.name));
  });
  return svg;
}
// Low (good) green, high (bad) red, yellow between: the sweep summary's heatmap.png colours.
function heatColor(t) {
  const stops = [[26, 152, 80], [255, 255, 191], [215, 48, 39]];
  const [a, b, u] = t < 0.5 ? [stops[0], stops[1], t * 2] : [stops[1], stops[2], (t - 0.5) * 2];
  return "rgb(" + a.map((c, k) => Math.round(c + (b[k] - c) * u)).join(",") + ")";
}
function heatmap(hm, metricName) {
  const cw = 86, ch = 36, L = 90, T = 30, B = 44;
  const W = L + cw * hm.lrs.length + 16, H = T + ch * hm.ranks.length + B;
  const vals = hm.values.flat().filter(v => v != null);
  const lo = Math.min(...vals), hi = Math.max(...vals);
  const svg = s("svg", {class: "chart", "data-chart": "heatmap", width: W, height: H},
                s("text", {class: "title", x: 8, y: 16}, metricName + " (lower is better, best outlined)"));
  hm.ranks.forEach((r, i) => {
    svg.append(s("text", {x: L - 8, y: T + ch * i + ch / 2 + 4, "text-anchor": "end"}, r));
    hm.lrs.forEach((lr, j) => {
      const v = hm.values[i][j];
      const fill = v == null ? "#eee" : heatColor(hi > lo ? (v - lo) / (hi - lo) : 0);
      const cell = s("rect", {x: L + cw * j, y: T + ch * i, width: cw - 2, height: ch - 2, fill: fill,
                              "data-rank": r, "data-lr": lr, "data-value": v == null ? "" : v,
                              stroke: v === lo ? "#000" : "none", "stroke-width": 2.5});
      svg.append(cell, s("text", {x: L + cw * j + cw / 2 - 1, y: T + ch * i + ch / 2 + 4, "text-anchor": "middle",
                                  style: "fill:#111"}, v == null ? "-" : fmt(v)));
    });
  });
  hm.lrs.forEach((lr, j) => svg.append(s("text", {x: L + cw * j + cw / 2, y: T + ch * hm.ranks.length + 14,
                                                 "text-anchor": "middle"}, lr)));
  svg.append(s("text", {x: L + cw * hm.lrs.length / 2, y: H - 8, "text-anchor": "middle"}, hm.lr_key),
             s("text", {x: 10, y: T + ch * hm.ranks.length / 2, transform: "rotate(-90 10 " +
                        (T + ch * hm.ranks.length / 2) + ")", "text-anchor": "middle"}, hm.rank_key));
  return svg;
}

// ---- the overview ------------------------------------------------------------------------------------------------
function overview(runs) {
  if (!runs.length) return h("div", {class: "empty"}, "no run here yet: runs appear once they start training");
  const head = ["run", "state", "progress", "ETA", "elapsed", "train loss (last step)", "val/loss", "lr"];
  return h("table", {}, h("tr", {}, head.map(x => h("th", {}, x))), runs.map(r =>
    h("tr", {class: "click" + (expanded.has(r.name) ? " open" : ""), "data-run": r.name,
             title: "show or hide its card", onclick: () => toggle(r.name)},
      h("td", {}, r.name), h("td", {}, stateBadge(r.state)),
      h("td", {}, progressBar(r.step, r.total_steps, r.state, false)),
      h("td", {"data-col": "eta"}, hms(r.eta_s)), h("td", {"data-col": "elapsed"}, hms(r.elapsed_s)),
      h("td", {"data-col": "loss"}, fmt(r.loss)), h("td", {"data-col": "val_loss"}, fmt(r.val_loss)),
      h("td", {"data-col": "lr"}, fmt(r.lr, 3)))));
}
function toggle(name) {
  if (expanded.has(name)) expanded.delete(name); else expanded.add(name);
  poll(false);
}

// ---- a run's card ------------------------------------------------------------------------------------------------
function stat(label, field, value) { return h("div", {}, h("label", {}, label), h("b", {"data-field": field}, value)); }
function runHead(d) {
  const st = d.status || {};
  const ago = d.updated != null ? hms(Math.max(0, NOW - d.updated)) + " ago" : "-";
  return [
    h("h2", {}, d.name, stateBadge(d.state),
      d.run_name && d.run_name !== d.name ? h("span", {class: "sub"}, d.run_name) : null,
      h("span", {class: "sub"}, d.folder)),
    h("div", {class: "mute"}, "step ", h("b", {"data-field": "step"}, d.step == null ? "-" : d.step), " of ",
      h("b", {"data-field": "total"}, d.total_steps == null ? "-" : d.total_steps)),
    progressBar(d.step, d.total_steps, d.state, true),
    st.error ? h("div", {class: "error"}, "error: " + st.error) : null,
    st.signal ? h("div", {class: "error"}, "stopped on " + st.signal +
                  (st.checkpoint ? "; resume from " + st.checkpoint : "")) : null,
    h("div", {class: "stats"},
      stat("ETA", "eta", hms(d.eta_s)),
      stat("elapsed (all sessions)", "elapsed", hms(d.elapsed_s)),
      stat("train loss (last step)", "loss", fmt(d.loss)),
      stat("val/loss", "val_loss", fmt(d.val_loss)),
      stat("lr (last step)", "lr", fmt(d.lr, 3)),
      stat("samples/s", "samples_per_s", fmt(st.samples_per_s, 3)),
      stat("epoch", "epoch", fmt(st.epoch)),
      stat("processes", "world_size", fmt(st.world_size)),
      stat("updated", "updated", ago),
      stat("last checkpoint", "checkpoint", (st.last_checkpoint || st.checkpoint || "-").split("/").pop())),
  ];
}
function gpus(d) {
  const st = d.status || {};
  const ranks = (d.ranks || []).length ? d.ranks : [];
  if (!ranks.some(r => r.mem_gib != null || r.gpu_util != null) && st.mem_gib == null) {
    return [h("h3", {}, "per GPU"), h("div", {class: "empty"}, "no GPU reported (a CPU run)" +
            (ranks.length > 1 ? "; " + ranks.length + " processes" : ""))];
  }
  const peak = Math.max(1e-9, ...ranks.map(r => r.peak_mem_gib || r.mem_gib || 0));
  const rows = ranks.map(r => h("tr", {"data-rank": r.rank},
    h("td", {}, r.rank), h("td", {}, fmt(r.step)), h("td", {}, fmt(r.loss)), h("td", {}, fmt(r.samples_per_s, 3)),
    h("td", {"data-col": "gpu_util"}, h("div", {class: "bar"}, h("div", {style: "width:" + (r.gpu_util || 0) + "%"}),
                                        h("span", {}, r.gpu_util == null ? "-" : fmt(r.gpu_util, 3) + " %"))),
    h("td", {"data-col": "gpu_power_w"}, h("div", {class: "bar"},
                                           h("div", {style: "width:" + 100 * (r.gpu_power_w || 0) /
                                                            (r.gpu_power_limit_w || r.gpu_power_w || 1) + "%"}),
                                           h("span", {}, r.gpu_power_w == null ? "-" : fmt(r.gpu_power_w, 3) + " W" +
                                             (r.gpu_power_limit_w == null ? "" : " of " + fmt(r.gpu_power_limit_w, 3))))),
    h("td", {"data-col": "gpu_clock_mhz"}, r.gpu_clock_mhz == null ? "-" : fmt(r.gpu_clock_mhz, 4) + " MHz"),
    h("td", {"data-col": "mem_gib"}, h("div", {class: "bar"},
                                       h("div", {style: "width:" + 100 * (r.mem_gib || 0) / peak + "%"}),
                                       h("span", {}, fmt(r.mem_gib, 3) + " GiB"))),
    h("td", {}, fmt(r.peak_mem_gib, 3) + " GiB"), h("td", {}, fmt(r.rejected_online))));
  return [h("h3", {}, "per GPU (at the last logged step; rank 0 now: " + fmt(st.mem_gib, 3) + " GiB, " +
            (st.gpu_util == null ? "-" : fmt(st.gpu_util, 3) + " %") + ")"),
          h("table", {}, h("tr", {}, ["rank", "step", "train loss", "samples/s", "utilisation", "power", "SM clock",
                                      "memory", "peak", "rejects"].map(x => h("th", {}, x))), rows)];
}
function curves(history) {
  const pick = k => history.filter(e => e[k] != null).map(e => [e.step, e[k]]);
  const val = pick("val_loss");
  return h("div", {class: "charts"},
    chart("loss", "loss", [{name: "train loss", points: pick("loss")},
                           {name: "val/loss", points: val, color: "#e4572e", dots: true}]),
    chart("lr", "learning rate", [{name: "lr", points: pick("lr"), color: "#17a398"}]));
}
function videos(list) {
  if (!list.length) return [h("h3", {}, "validation videos"), h("div", {class: "empty"}, "none yet")];
  const steps = [...new Set(list.map(v => v.step))];
  return [h("h3", {}, "validation videos"), steps.map(step => [
    h("div", {class: "mute"}, "step " + step + (list.some(v => v.step === step && v.base) ? " (the base model)" : "")),
    h("div", {class: "videos"}, list.filter(v => v.step === step).map(v =>
      h("figure", {class: "video", "data-step": v.step, "data-prompt": v.prompt == null ? "" : v.prompt},
        h("video", {src: withToken(v.url + "?v=" + v.mtime), controls: true, muted: true, loop: true, playsinline: true,
                    preload: "auto"}),
        h("figcaption", {}, h("b", {}, "step " + v.step + (v.base ? " · base" : " · LoRA")), " · ",
          h("span", {}, v.prompt == null ? "prompt " + v.prompt_index : v.prompt),
          h("span", {class: "mute"}, "  (p" + v.prompt_index + ", seed " + v.seed +
            (v.shape ? ", " + v.shape : "") + ")")))))])];
}
function pictures(list) {
  if (!list.length) return null;
  return h("div", {class: "pictures"}, list.map(p => [h("h3", {}, p.label),
    h("img", {src: withToken(p.url + "?v=" + p.mtime), alt: p.label})]));
}
function rejects(r) {
  const head = "rejects: " + fmt(r.before) + " before training, " + fmt(r.during) + " during";
  if (!r.total) return h("div", {class: "mute", "data-field": "rejects"}, head);
  return h("details", {"data-field": "rejects", open: r.total <= 10},
    h("summary", {}, head + (r.total > r.listed.length ? " (the first " + r.listed.length + " listed)" : "")),
    h("table", {}, h("tr", {}, ["when", "file", "reason"].map(x => h("th", {}, x))),
      r.listed.map(e => h("tr", {}, h("td", {}, e.when + (e.step != null ? " (step " + e.step + ")" : "")),
                          h("td", {}, e.source || e.path || "-"),
                          h("td", {style: "white-space:normal"}, e.reason || "-")))));
}
function runCard(card, d) {
  section(card, "head", {d: {...d, history: null, videos: null}, now: Math.floor(NOW)}, () => runHead(d));
  section(card, "gpus", [d.ranks, d.status && d.status.mem_gib, d.status && d.status.gpu_util], () => gpus(d));
  section(card, "curves", d.history, curves);
  section(card, "videos", d.videos, videos);
  section(card, "pictures", d.pictures, pictures);
  section(card, "rejects", d.rejects, rejects);
}

// ---- a sweep -----------------------------------------------------------------------------------------------------
function sweepCard(d) {
  const states = d.points.map(p => p.state);
  const counts = [...new Set(states)].sort().map(x => states.filter(y => y === x).length + " " + x).join(", ");
  const ranked = d.points.filter(p => p[d.metric] != null);
  const best = ranked.length ? ranked.reduce((a, b) => (b[d.metric] < a[d.metric] ? b : a)) : null;
  const head = ["point", ...d.keys, "state", "step", "train loss (mean of last 5)", "val/loss", "samples/s", "elapsed"];
  const rows = d.points.map(p => h("tr", {class: (p === best ? "best " : "") + (p.run ? "click" : ""),
                                          "data-point": p.point, onclick: p.run ? () => toggle(p.run) : null},
    h("td", {}, p.point), d.keys.map(k => h("td", {}, p.values[k] == null ? "-" : p.values[k])),
    h("td", {}, stateBadge(p.state)), h("td", {}, fmt(p.step) + " / " + fmt(p.total_steps)),
    h("td", {}, fmt(p.final_train_loss)), h("td", {}, fmt(p.val_loss)), h("td", {}, fmt(p.samples_per_s, 3)),
    h("td", {}, hms(p.elapsed_s))));
  const reasons = d.points.filter(p => p.reason).map(p => h("div", {class: "error"}, "point " + p.point + " " +
                                                           p.state + ": " + p.reason));
  const label = p => d.keys.map(k => k.split(".").pop() + "=" + (p.values[k] == null ? "-" : p.values[k]))
                           .join(" ") || p.point;
  return [
    h("h2", {}, "sweep " + d.name, h("span", {class: "sub"}, d.points.length + " points (" + counts + "); ranked by " +
      d.metric_name + ", lower is better, the best in bold")),
    h("table", {}, h("tr", {}, head.map(x => h("th", {}, x))), rows), reasons,
    h("div", {class: "charts", style: "margin-top:1em"},
      d.heatmap ? heatmap(d.heatmap, d.metric_name) : null,
      chart("sweep-loss", "train loss per point", d.points.map(p => ({name: label(p), points: p.curve})),
            {width: 560, height: 260})),
  ];
}

// ---- polling -----------------------------------------------------------------------------------------------------
let timer = null, busy = false;
async function poll(again) {
  if (busy) return;
  busy = true;
  const conn = document.getElementById("conn");
  try {
    const data = await getJSON("/api/runs");
    EVERY = data.every_s || EVERY; NOW = data.now || NOW;
    document.getElementById("root").textContent = data.root;
    for (const r of data.runs) {
      if (!seen.has(r.name)) {
        seen.add(r.name);
        if (data.runs.length <= 6 || r.state === "running") expanded.add(r.name);
      }
    }
    const shown = data.runs.filter(r => expanded.has(r.name));
    for (const r of shown) {
      const known = details[r.name];
      if (!known || known.updated !== r.updated || r.state === "running" || known.state !== r.state) {
        details[r.name] = await getJSON("/api/runs/" + encodeURIComponent(r.name));
      }
    }
    // a run with a card: its row shows the card's (newer) numbers, so that the two agree
    const rows = data.runs.map(r => !expanded.has(r.name) ? r :
      Object.fromEntries(Object.entries(r).map(([k, v]) => [k, k in details[r.name] ? details[r.name][k] : v])));
    const box = document.getElementById("runs");
    if (box.className === "empty") { box.className = ""; box.textContent = ""; }
    section(box, "table", {runs: rows, open: [...expanded]}, () => overview(rows));
    const sweeps = document.getElementById("sweeps");
    for (const sw of data.sweeps) {
      const d = await getJSON("/api/runs/" + encodeURIComponent(sw.name));
      let card = sweeps.querySelector(":scope > [data-sweep='" + CSS.escape(sw.name) + "']");
      if (!card) { card = h("section", {class: "card", "data-sweep": sw.name}); sweeps.append(card); }
      section(card, "sweep", d, sweepCard);
    }
    const cards = document.getElementById("cards");
    for (const el of [...cards.children]) if (!shown.some(r => r.name === el.dataset.run)) el.remove();
    for (const r of shown) {
      let card = cards.querySelector(":scope > [data-run='" + CSS.escape(r.name) + "']");
      if (!card) { card = h("section", {class: "card run", "data-run": r.name}); }
      cards.append(card);  // in the overview's order
      runCard(card, details[r.name]);
    }
    conn.className = "conn";
    conn.textContent = "live: refreshed " + new Date().toLocaleTimeString() + " (every " + EVERY + " s)";
  } catch (e) {
    conn.className = "conn down";
    conn.textContent = "cannot reach the server (" + e.message + "); retrying";
  } finally {
    busy = false;
  }
  if (again !== false) { clearTimeout(timer); timer = setTimeout(poll, EVERY * 1000); }
}
poll();
</script>
</body>
</html>
"""
