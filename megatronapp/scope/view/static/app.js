// MegaScope view: plain JS, no dependencies. Talks to the server over one
// websocket (token from this page's URL); arrays arrive as binary frames.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  info: null, steps: [], latencies: [], shown: [], series: null, ws: null, playing: null,
  stepsB: [], promptB: "", target: "a", doneB: false, trainingUpdates: 0,
  sel: { layer: 1, head: 0, token: -1, step: 0 }, topkOpen: false,
  perturbSent: null, analyses: {}, pca: null, gridDrawn: 0, dlaBars: [],
};
window.megascope = state; // read by the browser test and the latency benchmark

// ---------------------------------------------------------------- colours
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
const DIVERGING = [[33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43]]; // blue, white at 0.5, red
function colour(t, stops = VIRIDIS) {
  if (!Number.isFinite(t)) return [220, 220, 220];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
  return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
}
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];
const fmt = (v) => Number.isInteger(v) ? String(v) : (Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0)) ? v.toExponential(2) : v.toFixed(3);
const UNITS = { entropy: "nats", prev_token_mass: "share of attention", sink_mass: "share of attention", sparsity: "share", nan_count: "count", inf_count: "count", kurtosis: "excess, no unit" };
const unit = (stat) => UNITS[stat.split("(")[0]] || "tensor units";
const VISIBLE = { " ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍" };
// a token with its whitespace visible (␣ space, ↵ newline) and other control characters escaped
function show(c) {
  const esc = (ch) => VISIBLE[ch] || (ch < " " || ch === "\x7f" ? `\\x${ch.charCodeAt(0).toString(16).padStart(2, "0")}` : ch);
  return Array.from(String(c), esc).join("") || "∅";
}
function perturbLabel(p) { // the perturbation a generation ran with, for every chart it made
  if (!p) return "";
  if (p.kind === "head_mask") return `head_mask: head ${p.heads.join(", ")} zeroed at layer ${p.layer}`;
  if (p.kind === "act_noise") return `act_noise: σ = ${p.sigma} (relative) at ${p.site}, layer ${p.layer}`;
  return `act_offset: ${p.value >= 0 ? "+" : ""}${p.value} at ${p.site}, layer ${p.layer}`;
}
function quantile(sorted, q) {
  const i = (sorted.length - 1) * q, lo = Math.floor(i);
  return sorted[lo] + (sorted[Math.ceil(i)] - sorted[lo]) * (i - lo);
}
// the 1-99% quantile range of the finite values, padded 5%: a few outliers do not squash the rest
function robustRange(values, q = 0.01) {
  const s = values.filter(Number.isFinite).sort((a, b) => a - b);
  if (!s.length) return [0, 1];
  const lo = quantile(s, q), hi = quantile(s, 1 - q);
  if (lo === hi) return range(s);
  return [lo - (hi - lo) * 0.05, hi + (hi - lo) * 0.05];
}
// the first step at which the perturbed run picks another token than the clean one (-1: none)
function firstDivergence(steps) {
  return steps.findIndex((r) => r.header.perturbed && r.header.perturbed.token_id !== r.header.clean.token_id);
}
window.megascopeLib = { show, robustRange, firstDivergence, perturbLabel }; // for the browser test

// ---------------------------------------------------------------- frames
function decodeFrame(buf) {
  const n = new DataView(buf).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, n)));
  const data = new Float32Array(buf, 4 + n);
  const arrays = {};
  for (const s of header.arrays) {
    const size = s.shape.reduce((a, b) => a * b, 1);
    arrays[s.name] = { shape: s.shape, data: data.subarray(s.offset, s.offset + size) };
  }
  return { header, arrays };
}
function matrix(a, lead = []) { // a 2-D slice of an n-D array: rows x cols
  const [rows, cols] = a.shape.slice(-2);
  let off = 0, stride = rows * cols;
  for (let i = lead.length - 1, m = stride; i >= 0; i--) { off += lead[i] * m; m *= a.shape[i]; }
  return { rows, cols, at: (r, c) => a.data[off + r * cols + c] };
}

// ---------------------------------------------------------------- drawing
function clear(canvas) {
  canvas.hover = () => null;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "12px system-ui, sans-serif"; ctx.fillStyle = "#222"; ctx.strokeStyle = "#222";
  return ctx;
}
function message(canvas, text) {
  const ctx = clear(canvas);
  ctx.fillStyle = "#777"; ctx.fillText(text, 20, 30);
}
function tip(text, x, y) {
  const t = $("tip");
  t.hidden = !text;
  if (text) { t.textContent = text; t.style.left = `${x + 14}px`; t.style.top = `${y + 14}px`; }
}
// hovering a cell of a map shows text(row, col, value) beside the pointer
function hoverable(canvas, box, m, text) {
  canvas.hover = (x, y) => {
    const c = Math.floor((x - box.x) / box.w * m.cols), r = Math.floor((y - box.y) / box.h * m.rows);
    return r >= 0 && r < m.rows && c >= 0 && c < m.cols ? text(r, c, m.at(r, c)) : null;
  };
  if (canvas.dataset.hoverable) return;
  canvas.dataset.hoverable = "1";
  canvas.addEventListener("mousemove", (e) => {
    const rect = canvas.getBoundingClientRect();
    tip(canvas.hover((e.clientX - rect.left) * canvas.width / rect.width, (e.clientY - rect.top) * canvas.height / rect.height), e.clientX, e.clientY);
  });
  canvas.addEventListener("mouseleave", () => tip(null));
}
function range(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (lo === Infinity) return [0, 1];
  return lo === hi ? [lo - 0.5, hi + 0.5] : [lo, hi];
}
function legend(ctx, x, y, h, lo, hi, title, stops = VIRIDIS, tick = fmt) {
  for (let i = 0; i < h; i++) {
    const [r, g, b] = colour(1 - i / (h - 1), stops);
    ctx.fillStyle = `rgb(${r},${g},${b})`; ctx.fillRect(x, y + i, 14, 1);
  }
  ctx.fillStyle = "#222"; ctx.strokeRect(x, y, 14, h);
  ctx.fillText(tick(hi), x + 18, y + 8); ctx.fillText(tick(lo), x + 18, y + h);
  ctx.save(); ctx.translate(x + 70, y + h / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText(title, 0, 0); ctx.restore();
}
function axisTitles(ctx, box, xtitle, ytitle) {
  ctx.fillStyle = "#222"; ctx.textAlign = "center";
  ctx.fillText(xtitle, box.x + box.w / 2, box.y + box.h + 34);
  ctx.save(); ctx.translate(14, box.y + box.h / 2); ctx.rotate(-Math.PI / 2);
  ctx.fillText(ytitle, 0, 0); ctx.restore(); ctx.textAlign = "left";
}
function values(m) { const out = []; for (let r = 0; r < m.rows; r++) for (let c = 0; c < m.cols; c++) out.push(m.at(r, c)); return out; }
// the colour range: given, symmetric about 0 for a difference, or the values' own
function scaleOf(m, o) {
  if (o.lo !== undefined) return [o.lo, o.hi];
  if (!o.diverging) return range(values(m));
  const top = absMax(values(m));
  return [-top, top];
}
function absMax(vs) { return vs.reduce((m, v) => Number.isFinite(v) ? Math.max(m, Math.abs(v)) : m, 1e-6); }
function paintCells(ctx, box, m, [lo, hi], stops) {
  const cw = box.w / m.cols, ch = box.h / m.rows;
  for (let r = 0; r < m.rows; r++) for (let c = 0; c < m.cols; c++) {
    const [R, G, B] = colour((m.at(r, c) - lo) / (hi - lo), stops);
    ctx.fillStyle = `rgb(${R},${G},${B})`;
    ctx.fillRect(box.x + c * cw, box.y + r * ch, Math.ceil(cw), Math.ceil(ch));
  }
}
function cellTexts(ctx, box, m, [lo, hi], stops, text) { // a short label in each cell big enough for it
  const cw = box.w / m.cols, ch = box.h / m.rows;
  if (cw < 12 || ch < 12) return;
  ctx.textAlign = "center"; ctx.font = "11px monospace";
  for (let r = 0; r < m.rows; r++) for (let c = 0; c < m.cols; c++) {
    const t = text(r, c);
    if (t === undefined) continue;
    const [R, G, B] = colour((m.at(r, c) - lo) / (hi - lo), stops);
    ctx.fillStyle = 0.299 * R + 0.587 * G + 0.114 * B > 150 ? "#000" : "#fff"; // readable on its cell
    ctx.fillText(t, box.x + (c + .5) * cw, box.y + (r + .5) * ch + 4);
  }
  ctx.textAlign = "left"; ctx.font = "12px system-ui, sans-serif";
}
// m: {rows, cols, at}; o: {xlabels, ylabels, xtitle, ytitle, title, legend, lo, hi, diverging,
// mark: {row}, markCols: [col], hover(row, col, value), cellText(row, col), left, tick(value): legend labels}
function heatmap(canvas, m, o) {
  const ctx = clear(canvas), left = o.left || 70;
  const box = { x: left, y: 24, w: canvas.width - left - 120, h: canvas.height - 70 };
  const cw = box.w / m.cols, ch = box.h / m.rows;
  const [lo, hi] = scaleOf(m, o), stops = o.diverging ? DIVERGING : VIRIDIS;
  paintCells(ctx, box, m, [lo, hi], stops);
  if (o.cellText) cellTexts(ctx, box, m, [lo, hi], stops, o.cellText);
  ctx.strokeStyle = "#222"; ctx.strokeRect(box.x, box.y, box.w, box.h);
  ctx.lineWidth = 2; ctx.strokeStyle = "#d62728";
  if (o.mark && o.mark.row >= 0) ctx.strokeRect(box.x, box.y + o.mark.row * ch, box.w, ch);
  for (const c of o.markCols || []) ctx.strokeRect(box.x + c * cw, box.y, cw, box.h);
  ctx.lineWidth = 1;
  ctx.fillStyle = "#222";
  const every = (n, px) => Math.max(1, Math.ceil(n / Math.max(1, px / 14)));
  const sx = every(m.cols, box.w), sy = every(m.rows, box.h);
  ctx.textAlign = "center";
  for (let c = 0; c < m.cols; c += sx) ctx.fillText(o.xlabels ? o.xlabels(c) : c, box.x + (c + .5) * cw, box.y + box.h + 14);
  ctx.textAlign = "right";
  for (let r = 0; r < m.rows; r += sy) ctx.fillText(o.ylabels ? o.ylabels(r) : r, box.x - 4, box.y + (r + .5) * ch + 4);
  ctx.textAlign = "left";
  if (o.title) ctx.fillText(o.title, box.x, 14);
  canvas.setAttribute("aria-label", o.title || "");
  axisTitles(ctx, box, o.xtitle, o.ytitle);
  legend(ctx, box.x + box.w + 20, box.y, box.h, lo, hi, o.legend, stops, o.tick);
  hoverable(canvas, box, m, o.hover || ((r, c, v) => `${o.ytitle} ${o.ylabels ? o.ylabels(r) : r}, ${o.xtitle} ${o.xlabels ? o.xlabels(c) : c}: ${fmt(v)}`));
}
function plotBox(canvas) { return { x: 70, y: 24, w: canvas.width - 240, h: canvas.height - 70 }; }
// xticks: the x values to label (default: five, evenly spaced)
function axes(ctx, box, [x0, x1], [y0, y1], xticks) {
  ctx.strokeStyle = "#222"; ctx.strokeRect(box.x, box.y, box.w, box.h); ctx.fillStyle = "#222";
  const px = (x) => box.x + (x - x0) / (x1 - x0) * box.w, py = (y) => box.y + box.h - (y - y0) / (y1 - y0) * box.h;
  ctx.textAlign = "center";
  for (const xv of xticks || [0, 1, 2, 3, 4].map((i) => x0 + (x1 - x0) * i / 4)) ctx.fillText(fmt(xv), px(xv), box.y + box.h + 14);
  ctx.textAlign = "right";
  for (let i = 0; i <= 4; i++) ctx.fillText(fmt(y0 + (y1 - y0) * i / 4), box.x - 4, box.y + box.h - box.h * i / 4 + 4);
  ctx.textAlign = "left";
  return { px, py };
}
function integerTicks([x0, x1]) { // whole numbers only, at most about a dozen
  const first = Math.ceil(x0), last = Math.floor(x1), every = Math.max(1, Math.ceil((last - first + 1) / 12));
  const out = []; for (let x = first; x <= last; x += every) out.push(x);
  return out;
}
function keyOf(ctx, box, names) {
  names.forEach(([name, colr], i) => {
    ctx.fillStyle = colr; ctx.fillRect(box.x + box.w + 14, box.y + 6 + i * 18, 12, 12);
    ctx.fillStyle = "#222"; ctx.fillText(name, box.x + box.w + 30, box.y + 16 + i * 18);
  });
}
// lines: [{name, xs, ys, colour}]; o: {title, xtitle, ytitle, zero, integerX, marks: [{x, colour, label}]}
function lineChart(canvas, lines, o) {
  const ctx = clear(canvas), box = plotBox(canvas);
  let xr = range(lines.flatMap((l) => l.xs)), xticks;
  const yr = range(lines.flatMap((l) => l.ys));
  if (o.zero) yr[0] = Math.min(0, yr[0]);
  if (o.integerX) { xr = [xr[0] - 0.5, xr[1] + 0.5]; xticks = integerTicks(xr); canvas.dataset.xticks = xticks.join(","); }
  const { px, py } = axes(ctx, box, xr, yr, xticks);
  for (const l of lines) {
    ctx.strokeStyle = l.colour; ctx.fillStyle = l.colour; ctx.beginPath();
    let pen = false;
    l.xs.forEach((x, i) => {
      const y = l.ys[i];
      if (!Number.isFinite(y)) { pen = false; return; }
      pen ? ctx.lineTo(px(x), py(y)) : ctx.moveTo(px(x), py(y)); pen = true;
    });
    ctx.stroke();
    l.xs.forEach((x, i) => Number.isFinite(l.ys[i]) && ctx.fillRect(px(x) - 2, py(l.ys[i]) - 2, 4, 4));
  }
  for (const mk of o.marks || []) {
    ctx.strokeStyle = mk.colour; ctx.beginPath(); ctx.moveTo(px(mk.x), box.y); ctx.lineTo(px(mk.x), box.y + box.h); ctx.stroke();
    if (mk.label) { ctx.fillStyle = mk.colour; ctx.fillText(mk.label, px(mk.x) + 4, box.y + 12); }
  }
  ctx.fillStyle = "#222"; if (o.title) ctx.fillText(o.title, box.x, 14);
  canvas.setAttribute("aria-label", o.title || "");
  axisTitles(ctx, box, o.xtitle, o.ytitle);
  keyOf(ctx, box, lines.map((l) => [l.name, l.colour]));
}

// ---------------------------------------------------------------- selection
function current() { return state.steps[Math.min(state.sel.step, state.steps.length - 1)]; }
function selectedToken(rec) {
  const n = rec.header.window.length;
  return state.sel.token < 0 || state.sel.token >= n ? n - 1 : state.sel.token;
}
function fillSelect(sel, values, label = (v) => v) {
  const keep = sel.value;
  sel.replaceChildren(...values.map((v) => { const o = document.createElement("option"); o.value = v; o.textContent = label(v); return o; }));
  if (values.map(String).includes(keep)) sel.value = keep;
}

// ---------------------------------------------------------------- views
const flow = (text) => show(text).replace(/↵/g, "↵\n"); // visible newlines that still break the line
function renderTokens() {
  const box = $("tokens"), pbox = $("tokens-perturbed"), note = $("divergence");
  const first = state.steps[0];
  if (!first) { box.replaceChildren(); pbox.replaceChildren(); note.hidden = true; return; }
  const prompt = $("prompt").dataset.sent || "", diverge = firstDivergence(state.steps);
  const spans = (which) => state.steps.flatMap((rec, i) => {
    const v = rec.header[which]; const s = document.createElement("span");
    const marked = which === "perturbed" && i === diverge;
    s.className = "tok" + (i === state.sel.step ? " selected" : "") + (/^\s+$/.test(v.token) ? " ws" : "") + (marked ? " diverge" : "");
    s.dataset.step = i;
    s.title = `step ${i}: ${show(v.token)} p=${v.prob.toFixed(3)}${marked ? " (first divergent step)" : ""}`;
    s.style.backgroundColor = `rgba(31,119,180,${(0.1 + 0.6 * v.prob).toFixed(2)})`;
    const p = document.createElement("span"); p.className = "prob"; p.textContent = v.prob.toFixed(2);
    s.append(show(v.token), p);
    return v.token.includes("\n") ? [s, "\n"] : [s];
  });
  const label = (t) => { const l = document.createElement("span"); l.className = "label"; l.textContent = t; return l; };
  const pr = document.createElement("span"); pr.className = "prompt"; pr.textContent = flow(prompt);
  box.replaceChildren(label(first.header.perturbed ? "clean" : "text"), pr, ...spans("clean"));
  note.hidden = !first.header.perturbed;
  if (first.header.perturbed) {
    pbox.replaceChildren(label(`perturbed (${perturbLabel(state.perturbSent)})`), pr.cloneNode(true), ...spans("perturbed"));
    const d = state.steps[diverge];
    note.textContent = diverge < 0 ? `the perturbed run picks the clean run's token at every step so far`
      : `first divergent step: ${diverge} (clean ${show(d.header.clean.token)}, perturbed ${show(d.header.perturbed.token)}; marked in red)`;
  } else pbox.replaceChildren();
}
const TOPK_W = 520;
function topkBars(el, x0, run, title, v) { // one run's top-k as bars, its pick in red
  const left = x0 + 80, bar = 22, width = TOPK_W - 150;
  const kids = [el("text", { x: x0 + 10, y: 14 }, title)];
  v.topk.forEach((t, i) => {
    const y = 24 + i * bar;
    kids.push(el("text", { x: left - 6, y: y + 15, "text-anchor": "end", "font-family": "monospace" }, show(t.token)));
    kids.push(el("rect", { x: left, y, width: Math.max(1, t.prob * width), height: bar - 4, fill: t.token_id === v.token_id ? "#d62728" : "#1f77b4", class: "topk-bar", "data-run": run }));
    kids.push(el("text", { x: left + t.prob * width + 4, y: y + 15 }, t.prob.toFixed(3)));
  });
  const yAxis = 24 + v.topk.length * bar;
  kids.push(el("line", { x1: left, x2: left + width, y1: yAxis, y2: yAxis, stroke: "#222" }));
  kids.push(el("text", { x: left, y: yAxis + 14 }, "0"), el("text", { x: left + width, y: yAxis + 14, "text-anchor": "end" }, "1"));
  kids.push(el("text", { x: left + width / 2, y: yAxis + 20, "text-anchor": "middle" }, "probability"));
  return kids;
}
function renderTopk() {
  const panel = $("topk-panel"), rec = current();
  panel.hidden = !state.topkOpen || !rec;
  if (panel.hidden) return;
  const svg = $("topk"), NS = "http://www.w3.org/2000/svg";
  const el = (name, attrs, text) => { const e = document.createElementNS(NS, name); for (const k in attrs) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
  const runs = [["clean", "clean", rec.header.clean]];
  if (rec.header.perturbed) runs.push(["perturbed", `perturbed (${perturbLabel(state.perturbSent)})`, rec.header.perturbed]);
  const rows = Math.max(...runs.map(([, , v]) => v.topk.length));
  svg.setAttribute("height", 50 + rows * 22); svg.setAttribute("width", TOPK_W * runs.length);
  svg.replaceChildren(...runs.flatMap(([run, name, v], i) => topkBars(el, i * TOPK_W, run, `${name}: top ${v.topk.length}`, v)));
  const diverged = rec.header.perturbed && state.sel.step === firstDivergence(state.steps);
  $("topk-title").textContent = `step ${state.sel.step}: next-token probabilities after ${show(rec.header.window.slice(-1)[0] || "")}${diverged ? " (first divergent step)" : ""}`;
}
function renderStats() {
  const rec = current(), site = $("stat-site").value, stat = $("stat-name").value;
  if (!rec || !site) { message($("stats-canvas"), "no step yet"); message($("pixels-canvas"), "no step yet"); return; }
  const a = rec.arrays[`clean/stats/${site}/${stat}`], win = rec.header.window;
  const tok = (c) => show(win[c]);
  if (a) heatmap($("stats-canvas"), matrix(a), { xlabels: tok, ylabels: (r) => r + 1, xtitle: "token (window position)", ytitle: "layer", title: `${stat} of ${site} per layer and token (mean over heads)`, legend: `${stat} (${unit(stat)})`, mark: { row: state.sel.layer - 1 } });
  else message($("stats-canvas"), `no ${stat} at ${site}`);
  const px = rec.arrays[`clean/pixels/${site}`];
  if (px) heatmap($("pixels-canvas"), matrix(px, [state.sel.layer - 1]), { xlabels: (c) => c, ylabels: tok, xtitle: "channel block (heads side by side for per-head sites)", ytitle: "token", title: `pooled pixels (absmax per channel block) of ${site}, layer ${state.sel.layer}`, legend: "absmax (tensor units)", mark: { row: selectedToken(rec) } });
  else message($("pixels-canvas"), `no pooled pixels at ${site}`);
}
// ------------------------------------------------ attention: the grid, the enlarged maps, differences
function stepB() { return state.stepsB.length ? state.stepsB[Math.min(state.sel.step, state.stepsB.length - 1)] : undefined; }
function attnOf(which, layer, head) { // one run's map: {m, win}, or null
  const rec = which === "b" ? stepB() : current();
  const a = rec && rec.arrays[`${which === "b" ? "clean" : which}/attention/layer${layer}`];
  return a ? { m: matrix(a, [head]), win: rec.header.window } : null;
}
const DIFFS = { "perturbed-clean": ["perturbed", "clean"], "b-a": ["b", "clean"] };
// a run's map, or a difference of two over the positions both have (attention is causal, so
// the first n queries of two windows attend the same first n keys)
function attnView(kind, layer, head) {
  if (!DIFFS[kind]) return attnOf(kind, layer, head);
  const [x, y] = DIFFS[kind].map((w) => attnOf(w, layer, head));
  if (!x || !y) return null;
  const n = Math.min(x.m.rows, y.m.rows);
  return { m: { rows: n, cols: n, at: (r, c) => x.m.at(r, c) - y.m.at(r, c) }, win: x.win, other: y.win, diverging: true };
}
function tokOf(v, i) { return v.other && v.other[i] !== v.win[i] ? `${show(v.win[i])}|${show(v.other[i])}` : show(v.win[i]); }
function pairText(v, where) {
  return (r, c, w) => `${where}query ${r} ${tokOf(v, r)} → key ${c} ${tokOf(v, c)}: ${v.diverging ? "Δ " : ""}${Number.isFinite(w) ? w.toFixed(4) : "–"}`;
}
const VIEW_NAMES = { clean: "prompt A, clean", perturbed: "prompt A, perturbed", "perturbed-clean": "perturbed − clean", b: "prompt B", "b-a": "prompt B − prompt A" };
function layerCount() { return state.info && state.info.live ? state.info.live.layers : 0; }
function headCount() { return state.info && state.info.live ? state.info.live.heads : 0; }
const MINI = 110;
function buildGrid(grid, layers, heads) {
  grid.style.gridTemplateColumns = `auto repeat(${heads}, ${MINI}px)`;
  const cell = (cls, text) => { const d = document.createElement("div"); d.className = cls; d.textContent = text; return d; };
  const kids = [cell("colhead", ""), ...Array.from({ length: heads }, (_, h) => cell("colhead", `head ${h}`))];
  for (let layer = 1; layer <= layers; layer++) {
    kids.push(cell("rowhead", `layer ${layer}`));
    for (let head = 0; head < heads; head++) {
      const c = document.createElement("canvas");
      Object.assign(c, { className: "mini", width: MINI, height: MINI });
      Object.assign(c.dataset, { layer, head });
      kids.push(c);
    }
  }
  grid.replaceChildren(...kids);
}
function renderGrid() {
  const grid = $("attn-grid"), kind = $("attn-grid-of").value, layers = layerCount(), heads = headCount();
  if (grid.querySelectorAll("canvas.mini").length !== layers * heads) buildGrid(grid, layers, heads);
  const views = new Map();
  for (const c of grid.querySelectorAll("canvas.mini")) views.set(c, attnView(kind, Number(c.dataset.layer), Number(c.dataset.head)));
  const shown = [...views.values()].filter(Boolean);
  const diverging = shown.length && shown[0].diverging, top = absMax(shown.flatMap((v) => values(v.m)));
  const scale = diverging ? [-top, top] : [0, 1];
  for (const [c, v] of views) {
    const layer = Number(c.dataset.layer), head = Number(c.dataset.head);
    c.classList.toggle("selected", layer === state.sel.layer && head === state.sel.head);
    const ctx = clear(c);
    if (!v) continue;
    const box = { x: 0, y: 0, w: c.width, h: c.height };
    paintCells(ctx, box, v.m, scale, v.diverging ? DIVERGING : VIRIDIS);
    hoverable(c, box, v.m, pairText(v, `layer ${layer}, head ${head}: `));
    c.setAttribute("aria-label", `${VIEW_NAMES[kind]}, layer ${layer}, head ${head}`);
  }
  state.gridDrawn = shown.length;
  const colours = diverging ? `blue ${fmt(scale[0])} … white 0 … red ${fmt(scale[1])} (one scale for the grid)` : "attention probability 0 (dark) … 1 (yellow)";
  const perturbed = kind.startsWith("perturbed") ? `; ${perturbLabel(state.perturbSent)}` : "";
  $("attn-grid-note").textContent = shown.length ? `${VIEW_NAMES[kind]} at step ${state.sel.step}: query down, key across; ${colours}${perturbed}; hover for values`
    : `no ${VIEW_NAMES[kind]} yet (${kind.includes("b") ? "generate prompt B" : kind.includes("perturbed") ? "generate with 'perturb' ticked" : "generate a prompt"})`;
}
function attentionMap(canvas, v, title, legendTitle) {
  if (!v) { message(canvas, "nothing to show"); return; }
  const tok = (i) => tokOf(v, i);
  heatmap(canvas, v.m, { xlabels: tok, ylabels: tok, xtitle: "key token", ytitle: "query token", title, legend: legendTitle, diverging: v.diverging, ...(v.diverging ? {} : { lo: 0, hi: 1 }), mark: { row: v.diverging || !current() ? -1 : Math.min(selectedToken(current()), v.m.rows - 1) }, hover: pairText(v, "") });
}
function renderAttention() {
  const { layer, head, step } = state.sel, at = `layer ${layer}, head ${head}, step ${step}`;
  renderGrid();
  $("attn-prompt-a").textContent = show($("prompt").dataset.sent || "");
  $("attn-enlarged").textContent = `Selected map: ${at}`;
  if (!current()) message($("attn-canvas"), "no step yet");
  else attentionMap($("attn-canvas"), attnOf("clean", layer, head), at, "attention probability");
  const perturbed = attnOf("perturbed", layer, head);
  $("attn-perturbed-fig").hidden = !perturbed;
  $("attn-perturbed-fig").querySelector("figcaption").textContent = `prompt A, perturbed (${perturbLabel(state.perturbSent)})`;
  if (perturbed) attentionMap($("attn-canvas-p"), perturbed, at, "attention probability");
  // prompt B: the same layer, head and step (its last step when it is shorter)
  $("attn-b-fig").hidden = !state.stepsB.length;
  $("attn-prompt-b").textContent = show(state.promptB);
  if (state.stepsB.length) attentionMap($("attn-canvas-b"), attnOf("b", layer, head), `layer ${layer}, head ${head}, step ${Math.min(step, state.stepsB.length - 1)}`, "attention probability");
  const kind = $("attn-diff-of").value, diff = attnView(kind, layer, head);
  $("attn-diff-fig").hidden = !(perturbed || state.stepsB.length);
  $("attn-diff-caption").textContent = kind === "perturbed-clean" ? perturbLabel(state.perturbSent) : diff ? `first ${diff.m.rows} positions of both windows` : "";
  if (diff) attentionMap($("attn-canvas-d"), diff, `${VIEW_NAMES[kind]}, ${at}`, "difference of attention probability");
  else message($("attn-canvas-d"), kind === "b-a" ? "no prompt B yet" : "no perturbed generation yet");
}
// ------------------------------------------------ PCA
function pcaPoints(layer) { // the layer's points at every step, both runs: the axes hold still over the timeline
  const xs = [], ys = [];
  for (const rec of state.steps) for (const [name, a] of Object.entries(rec.arrays)) {
    if (!name.endsWith(`/pca/layer${layer}`)) continue;
    for (let i = 0; i < a.data.length; i += 2) { xs.push(a.data[i]); ys.push(a.data[i + 1]); }
  }
  return [xs, ys];
}
function renderPca() {
  const canvas = $("pca-canvas"), rec = current();
  if (!rec) { message(canvas, "no step yet"); return; }
  const ctx = clear(canvas), box = { ...plotBox(canvas), y: 40, h: canvas.height - 86 }, [xs, ys] = pcaPoints(state.sel.layer);
  const xr = robustRange(xs), yr = robustRange(ys);
  const { px, py } = axes(ctx, box, xr, yr), keys = [];
  const clip = (v, [lo, hi]) => Math.min(Math.max(v, lo), hi);
  const point = (a, i) => [a.data[2 * i], a.data[2 * i + 1]];
  const inside = ([x, y]) => x >= xr[0] && x <= xr[1] && y >= yr[0] && y <= yr[1];
  const at = ([x, y]) => [px(clip(x, xr)), py(clip(y, yr))];
  const sel = selectedToken(rec), win = rec.header.window;
  let clipped = 0, points = 0;
  [["clean", "#1f77b4"], ["perturbed", "#d62728"]].forEach(([which, colr]) => {
    const a = rec.arrays[`${which}/pca/layer${state.sel.layer}`];
    if (!a) return;
    keys.push([`${which} tokens`, colr]);
    ctx.strokeStyle = colr; ctx.globalAlpha = 0.4; ctx.beginPath();
    for (let i = 0; i < a.shape[0]; i++) (i ? ctx.lineTo : ctx.moveTo).call(ctx, ...at(point(a, i)));
    ctx.stroke(); ctx.globalAlpha = 1; ctx.fillStyle = colr; ctx.strokeStyle = colr;
    for (let i = 0; i < a.shape[0]; i++) {
      const [x, y] = at(point(a, i)), r = i === sel ? 6 : 3;
      points++;
      ctx.beginPath();
      if (inside(point(a, i))) { ctx.arc(x, y, r, 0, 2 * Math.PI); ctx.fill(); continue; }
      clipped++; // beyond the 1-99% range: an open triangle on the edge
      ctx.moveTo(x, y - r - 2); ctx.lineTo(x + r + 2, y + r + 2); ctx.lineTo(x - r - 2, y + r + 2); ctx.closePath(); ctx.stroke();
    }
    if (which !== "clean") return;
    ctx.font = "10px monospace"; // the clean tokens' labels (the perturbed run reads the same window)
    for (let i = 0; i < a.shape[0]; i++) { const [x, y] = at(point(a, i)); ctx.fillText(show(win[i]), x + 4, y - 4); }
    ctx.font = "12px system-ui, sans-serif";
  });
  const last = state.steps.slice(0, state.sel.step + 1).map((r) => r.arrays[`clean/pca/layer${state.sel.layer}`]).filter(Boolean);
  ctx.strokeStyle = "#2ca02c"; ctx.lineWidth = 2; ctx.beginPath();
  last.forEach((a, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, ...at(point(a, a.shape[0] - 1))));
  ctx.stroke(); ctx.lineWidth = 1;
  keys.push(["last token, steps", "#2ca02c"], [`△ beyond 1–99%: ${clipped}`, "#fff"]);
  state.pca = { clipped, points, xr, yr };
  const title = `layer ${state.sel.layer}, step ${state.sel.step}; selected token ${show(win[sel])} (large dot); axes: 1–99% of the layer's points over all steps`;
  const perturbed = rec.header.perturbed ? `perturbed: ${perturbLabel(state.perturbSent)}` : "";
  ctx.fillStyle = "#222"; ctx.fillText(title, box.x, 14); ctx.fillText(perturbed, box.x, 30);
  canvas.setAttribute("aria-label", `${title}; ${perturbed}`);
  axisTitles(ctx, box, "PC 1 (fixed basis, hidden-state units)", "PC 2");
  keyOf(ctx, box, keys);
}
function renderPerturbation() {
  const withP = state.steps.filter((r) => r.header.perturbed);
  if (!withP.length) { message($("kl-canvas"), "no perturbed generation yet: tick 'perturb' and generate"); message($("dh-canvas"), ""); return; }
  const made = perturbLabel(state.perturbSent), diverge = firstDivergence(state.steps);
  const marks = [{ x: state.sel.step, colour: "#999" }, ...(diverge < 0 ? [] : [{ x: diverge, colour: "#d62728", label: `first divergent step (${diverge})` }])];
  lineChart($("kl-canvas"), [{ name: "KL(clean‖perturbed)", xs: withP.map((r) => r.header.step), ys: withP.map((r) => r.header.kl), colour: "#d62728" }], { xtitle: "decoding step", ytitle: "KL (nats)", title: `KL divergence of the next-token distributions per step; ${made}`, marks, zero: true, integerX: true });
  const dh = (current() || withP[0]).header.delta_h || {};
  const layers = Object.keys(dh).map(Number).sort((a, b) => a - b);
  lineChart($("dh-canvas"), [{ name: "‖Δh‖/‖h‖", xs: layers, ys: layers.map((l) => dh[l]), colour: "#9467bd" }], { xtitle: "layer", ytitle: "‖Δh‖/‖h‖ (ratio)", title: `relative change of the last token's hidden state per layer, step ${state.sel.step}; ${made}`, zero: true, integerX: true });
}
function renderTraining() {
  const s = state.series, canvas = $("train-canvas");
  if (!s) { message(canvas, state.info && Object.keys(state.info.series).length ? "loading…" : "the capture has no scalar statistics"); return; }
  const steps = Array.from(s.arrays.steps.data), v = s.arrays.values;
  const lines = s.header.layers.map((layer, i) => ({ name: `layer ${layer}`, xs: steps, ys: steps.map((_, j) => v.data[i * steps.length + j]), colour: PALETTE[i % PALETTE.length] }));
  lineChart(canvas, lines, { xtitle: "step", ytitle: `${s.header.stat} (${unit(s.header.stat)})`, title: `${s.header.stat} of ${s.header.site} per layer over steps` });
  renderRidges();
}
const MAX_RIDGES = 40; // the latest steps, so the ridges stay readable
function renderRidges() {
  const s = state.series, canvas = $("ridge-canvas");
  if (!s) { message(canvas, "no statistic selected"); return; }
  const edges = s.arrays.ridge_edges.data, counts = matrix(s.arrays.ridge_counts);
  const steps = Array.from(s.arrays.steps.data), first = Math.max(0, steps.length - MAX_RIDGES);
  const shown = steps.slice(first), bins = counts.cols;
  state.ridges = shown.length;
  if (!shown.length) { message(canvas, "no steps yet"); return; }
  const ctx = clear(canvas), box = plotBox(canvas);
  const x0 = edges[0], x1 = edges[bins];
  const px = (x) => box.x + (x - x0) / (x1 - x0) * box.w;
  const gap = box.h / (shown.length + 1.5), height = gap * 2.5; // ridges overlap a little; the first fits
  ctx.strokeStyle = "#222"; ctx.strokeRect(box.x, box.y, box.w, box.h); ctx.fillStyle = "#222";
  ctx.textAlign = "center";
  for (let i = 0; i <= 4; i++) ctx.fillText(fmt(x0 + (x1 - x0) * i / 4), box.x + box.w * i / 4, box.y + box.h + 14);
  ctx.textAlign = "right";
  const every = Math.max(1, Math.ceil(shown.length / Math.max(1, box.h / 14)));
  shown.forEach((step, i) => { // earliest at the top, drawn first so later ridges overlap it
    const base = box.y + gap * (i + 2.5), row = first + i;
    let peak = 0; for (let b = 0; b < bins; b++) peak = Math.max(peak, counts.at(row, b));
    if (i % every === 0) { ctx.fillStyle = "#222"; ctx.fillText(step, box.x - 4, base + 4); }
    if (peak === 0) return;
    const [R, G, B] = colour(shown.length > 1 ? i / (shown.length - 1) : 1);
    ctx.beginPath(); ctx.moveTo(px(x0), base);
    for (let b = 0; b < bins; b++) ctx.lineTo(px((edges[b] + edges[b + 1]) / 2), base - height * counts.at(row, b) / peak);
    ctx.lineTo(px(x1), base); ctx.closePath();
    ctx.fillStyle = `rgba(${R},${G},${B},0.75)`; ctx.fill(); ctx.strokeStyle = "#fff"; ctx.stroke();
  });
  ctx.textAlign = "left"; ctx.fillStyle = "#222";
  ctx.fillText(`distribution of ${s.header.stat} of ${s.header.site} per step over layers, heads and tokens (each ridge scaled to its own peak)`, box.x, 14);
  axisTitles(ctx, box, `${s.header.stat} (${unit(s.header.stat)})`, "step");
  legend(ctx, box.x + box.w + 20, box.y, box.h, shown[0], shown[shown.length - 1], "step (ridge colour)");
}
// ------------------------------------------------ stored analyses: logit lens, activation patching
function analysisMenu(select, kind) {
  const names = Object.keys((state.info && state.info.analyses) || {}).filter((n) => n.startsWith(`${kind}-`));
  fillSelect(select, names, (n) => state.info.analyses[n]);
}
function storedResult(name) { // the result, or undefined while it is asked for
  if (name && !(name in state.analyses)) { state.analyses[name] = null; send({ type: "analysis", name }); }
  return state.analyses[name] || undefined;
}
const mapSize = (canvas, cols, rows, rowPx) => { canvas.width = Math.max(900, 260 + 22 * cols); canvas.height = 100 + rowPx * rows; };
function renderLens() {
  const name = $("lens-of").value, canvas = $("lens-canvas"), r = storedResult(name);
  $("lens-summary").textContent = "";
  if (!name) { message(canvas, "no logit lens stored with this capture: megatronapp scope lens RUN_DIR --prompt TEXT"); return; }
  if (!r) { message(canvas, "loading…"); return; }
  const rank = (row, p) => (p < r.rank[row].length ? r.rank[row][p] : NaN);
  const worst = Math.max(1, ...r.rank.flat());
  mapSize(canvas, r.tokens.length, r.rows.length, 44);
  const next = (p) => (p + 1 < r.tokens.length ? show(r.tokens[p + 1]) : "(end of prompt)");
  heatmap(canvas, { rows: r.rows.length, cols: r.tokens.length, at: (row, p) => Math.log10(1 + rank(row, p)) }, {
    left: 110, xlabels: (p) => show(r.tokens[p]), ylabels: (row) => r.rows[row], xtitle: "position (the token read)", ytitle: "",
    title: `logit lens of ${JSON.stringify(r.prompt)}: rank of the next token where each row reads the stream (cells: the lens's first choice)`,
    legend: "rank of the next token (log scale)", lo: 0, hi: Math.log10(1 + worst), tick: (v) => String(Math.round(10 ** v - 1)),
    cellText: (row, p) => show(r.top[row][p][0].token),
    hover: (row, p) => `${r.rows[row]}, position ${p} ${show(r.tokens[p])} → next ${next(p)}: rank ${Number.isNaN(rank(row, p)) ? "–" : rank(row, p)}\ntop: ${r.top[row][p].map((t) => `${show(t.token)} ${t.prob === null ? "–" : t.prob.toFixed(3)}`).join("  ")}`,
  });
  $("lens-summary").textContent = `mean rank of the next token (0: the lens's first choice): ${r.rows.map((row, i) => `${row} ${r.mean_rank[i] === null ? "–" : r.mean_rank[i].toFixed(2)}`).join(" → ")}`;
}
function renderPatching() {
  const name = $("patch-of").value, box = $("patch-maps"), r = storedResult(name);
  if (!name || !r) {
    box.replaceChildren();
    $("patch-summary").textContent = name ? "loading…" : "no activation patching stored with this capture: megatronapp scope patch RUN_DIR --clean TEXT --corrupt TEXT";
    return;
  }
  const clean = Array.from(r.clean), corrupt = Array.from(r.corrupt);
  const differs = corrupt.map((c, p) => c !== clean[p] ? p : -1).filter((p) => p >= 0);
  $("patch-summary").textContent = `clean ${JSON.stringify(r.clean)} → ${show(r.answers[0])}, corrupted ${JSON.stringify(r.corrupt)} → ${show(r.answers[1])}: the restored logit difference, (patched − corrupted) / (clean − corrupted), when one site at one layer and position is taken from the clean run (1: the clean answer back, 0: no change); the positions where the prompts differ are outlined`;
  box.replaceChildren(...r.sites.map((site, s) => {
    const c = document.createElement("canvas");
    c.className = "patch-map"; c.dataset.site = site;
    mapSize(c, r.tokens.length, r.layers.length, 40);
    heatmap(c, { rows: r.layers.length, cols: r.tokens.length, at: (l, p) => r.restored[s][l][p] ?? NaN }, {
      diverging: true, lo: -1, hi: 1, xlabels: (p) => show(r.tokens[p]), ylabels: (l) => r.layers[l], markCols: differs,
      xtitle: "position (corrupted prompt)", ytitle: "layer", title: `${site}: restored logit difference`, legend: "restored (1: clean)",
      cellText: (l, p) => (Number.isFinite(r.restored[s][l][p]) ? r.restored[s][l][p].toFixed(2) : undefined),
      hover: (l, p, v) => `${site}, layer ${r.layers[l]}, position ${p} ${show(r.tokens[p])}: restored ${Number.isFinite(v) ? v.toFixed(4) : "–"}`,
    });
    return c;
  }));
}
// ------------------------------------------------ stored analyses: direct logit attribution
const DLA_KINDS = { head: ["attention head", "#1f77b4"], attn_bias: ["attention bias", "#7f7f7f"], mlp: ["MLP", "#ff7f0e"], embed: ["embedding", "#2ca02c"], norm_bias: ["final norm's bias", "#9467bd"] };
// the bars in the order drawn, null a gap between groups: the embedding, each layer's heads,
// attention bias and MLP, the final norm's bias
function dlaBars(r) {
  const bar = (kind, component, label, layer, value) => ({ kind, component, label, layer, value: value ?? NaN });
  const slots = [bar("embed", "embedding", "emb", null, r.embed), null];
  r.layers.forEach((layer, l) => {
    r.heads[l].forEach((v, h) => slots.push(bar("head", `layer ${layer}, head ${h}`, `h${h}`, layer, v)));
    slots.push(bar("attn_bias", `layer ${layer}, attention bias`, "bias", layer, r.attn_bias[l]), bar("mlp", `layer ${layer}, MLP`, "mlp", layer, r.mlp[l]), null);
  });
  slots.push(bar("norm_bias", "final norm's bias", "norm", null, r.norm_bias));
  return slots;
}
const signed = (v) => (Number.isFinite(v) ? `${v >= 0 ? "+" : ""}${v.toFixed(4)}` : "–");
const sum = (vs) => vs.reduce((a, v) => a + (v ?? NaN), 0);
function drawBars(ctx, box, slots, py) { // signed bars from the zero line, their labels and layers below
  const sw = box.w / slots.length;
  ctx.strokeStyle = "#222"; ctx.beginPath(); ctx.moveTo(box.x, py(0)); ctx.lineTo(box.x + box.w, py(0)); ctx.stroke();
  ctx.textAlign = "center";
  slots.forEach((b, i) => {
    if (!b) return;
    const x = box.x + i * sw;
    ctx.fillStyle = DLA_KINDS[b.kind][1];
    if (Number.isFinite(b.value)) ctx.fillRect(x + sw * 0.15, Math.min(py(0), py(b.value)), sw * 0.7, Math.abs(py(b.value) - py(0)));
    ctx.fillStyle = "#222"; ctx.fillText(b.label, x + sw / 2, box.y + box.h + 14);
    if (b.layer !== null && (!slots[i - 1] || slots[i - 1].layer !== b.layer)) ctx.fillText(`layer ${b.layer}`, x + sw * (slots.indexOf(null, i) - i) / 2, box.y + box.h + 30);
  });
  ctx.textAlign = "left";
  return sw;
}
function renderDla() {
  const name = $("dla-of").value, canvas = $("dla-canvas"), r = storedResult(name);
  $("dla-summary").textContent = ""; state.dlaBars = [];
  if (!name) { message(canvas, "no direct logit attribution stored with this capture: megatronapp scope dla RUN_DIR --prompt TEXT"); return; }
  if (!r) { message(canvas, "loading…"); return; }
  const slots = dlaBars(r), diff = `logit[${show(r.answers[0])}] − logit[${show(r.answers[1])}]`;
  const total = `${diff} = ${r.logit_diff === null ? "–" : r.logit_diff.toFixed(4)}`;
  canvas.width = Math.max(900, 260 + 22 * slots.length);
  const ctx = clear(canvas), box = plotBox(canvas);
  const top = absMax(slots.filter(Boolean).map((b) => b.value)) * 1.05; // symmetric: 0 is the middle tick
  const { py } = axes(ctx, box, [0, slots.length], [-top, top], []);
  const sw = drawBars(ctx, box, slots, py);
  const title = `direct logit attribution of ${JSON.stringify(r.prompt)} at its last position: ${total} (each bar: its share)`;
  ctx.fillStyle = "#222"; ctx.fillText(title, box.x, 14); canvas.setAttribute("aria-label", title);
  axisTitles(ctx, box, "", `share of ${diff}`);
  keyOf(ctx, box, Object.values(DLA_KINDS));
  hoverable(canvas, box, { rows: 1, cols: slots.length, at: (_, c) => slots[c] }, (_, c, b) => (b ? `${b.component}: ${signed(b.value)} of ${total}` : null));
  state.dlaBars = slots.flatMap((b, i) => (b ? [{ component: b.component, x: box.x + (i + 0.5) * sw, y: box.y + box.h / 2 }] : []));
  $("dla-summary").textContent = `${total}: attention heads ${signed(sum(r.heads.flat()))}, attention biases ${signed(sum(r.attn_bias))}, MLPs ${signed(sum(r.mlp))}, embedding ${signed(r.embed ?? NaN)}, final norm's bias ${signed(r.norm_bias ?? NaN)}`;
}
function renderQuick() {
  const rec = current(), n = state.steps.length;
  $("timeline").max = Math.max(0, n - 1); $("timeline").value = state.sel.step;
  $("timeline-label").textContent = n ? `${state.sel.step} / ${n - 1}` : "–";
  if (rec) {
    const w = rec.header.window.length, t = selectedToken(rec);
    $("q-token").max = w - 1; $("q-token").value = t;
    $("q-token-label").textContent = `${t} ${show(rec.header.window[t])}`;
  }
}
const VIEWS = { generation: renderTopk, tensors: renderStats, attention: renderAttention, pca: renderPca, perturbation: renderPerturbation, training: renderTraining, lens: renderLens, patching: renderPatching, dla: renderDla };
function activeTab() { const b = document.querySelector("#tabs button.active"); return b ? b.dataset.tab : "generation"; }
function renderAll() { // only what is on screen: the others draw when their tab opens
  renderQuick(); renderTokens(); VIEWS[activeTab()]();
}

// ---------------------------------------------------------------- messages
function status(text) { $("status").textContent = text; }
function onInfo(info) {
  state.info = info;
  const live = info.live, layers = live ? live.layers : Math.max(1, ...info.series_layers);
  const heads = live ? live.heads : 1;
  fillSelect($("q-layer"), Array.from({ length: layers }, (_, i) => i + 1));
  fillSelect($("p-layer"), Array.from({ length: layers }, (_, i) => i + 1));
  fillSelect($("q-head"), Array.from({ length: heads }, (_, i) => i));
  fillSelect($("p-head"), Array.from({ length: heads }, (_, i) => i));
  fillSelect($("p-site"), ["resid_post", "resid_pre", "attn.q", "attn.k", "attn.v", "attn.out", "mlp.pre", "mlp.post", "mlp.out"]);
  fillSelect($("t-site"), Object.keys(info.series));
  onTrainingSite();
  analysisMenu($("lens-of"), "lens"); analysisMenu($("patch-of"), "patch"); analysisMenu($("dla-of"), "dla");
  showPerturbFields();
  $("perturb-off").hidden = info.allow_perturb;
  for (const e of $("perturb-controls").querySelectorAll("select, input")) e.disabled = !info.allow_perturb;
  $("use-perturb").disabled = !info.allow_perturb;
  $("generate").disabled = !live;
  $("dropped").textContent = trainingText(info);
  const dl = $("capture-info");
  dl.replaceChildren(...[["capture", info.capture], ["source", info.source], ["model", info.model ? `${info.model.layers} layers, hidden ${info.model.hidden}, ${info.model.heads} heads` : "?"], ["live generation", live ? "on" : "off (no checkpoint)"], ["dropped records", info.dropped_records]]
    .flatMap(([k, v]) => { const dt = document.createElement("dt"), dd = document.createElement("dd"); dt.textContent = k; dd.textContent = v; return [dt, dd]; }));
  status(live ? "ready: enter a prompt" : info.following ? "following the run (no live generation)" : "capture only (no checkpoint)");
}
function onStep(frame) {
  if (state.target === "b") { state.stepsB.push(frame); if (activeTab() === "attention") renderAttention(); return; }
  state.steps.push(frame);
  if (state.steps.length === 1) {
    const sites = [...new Set(Object.keys(frame.arrays).filter((n) => n.startsWith("clean/stats/")).map((n) => n.split("/")[2]))];
    fillSelect($("stat-site"), sites); onStatSite();
  }
  if ($("follow").checked) state.sel.step = state.steps.length - 1;
  const t0 = performance.now();
  renderAll();
  state.shown.push(document.querySelectorAll("#tokens .tok").length); // tokens on screen after each frame
  requestAnimationFrame(() => { // the view is on screen: decoded -> shown
    const shown = performance.timeOrigin + performance.now();
    state.latencies.push({ step: frame.header.step, latency_ms: shown - frame.header.decoded_at * 1000, render_ms: performance.now() - t0, decode_cpu_s: frame.header.decode_cpu_s, decode_wall_s: frame.header.decode_wall_s });
  });
  status(`step ${frame.header.step}: ${show(frame.header.clean.token)} p=${frame.header.clean.prob.toFixed(3)}`);
}
function onMessage(ev) {
  if (typeof ev.data !== "string") {
    const frame = decodeFrame(ev.data);
    if (frame.header.kind === "step") onStep(frame);
    else if (frame.header.kind === "series") { state.series = frame; renderTraining(); }
    return;
  }
  const m = JSON.parse(ev.data);
  if (m.kind === "info") onInfo(m);
  else if (m.kind === "done") { status(`done: ${m.steps} tokens${m.stopped ? " (stopped)" : ""}`); if (state.target === "b") state.doneB = true; else state.done = true; }
  else if (m.kind === "training") onTraining(m);
  else if (m.kind === "analysis") { state.analyses[m.name] = m.result; if (["lens", "patching", "dla"].includes(activeTab())) VIEWS[activeTab()](); }
  else if (m.kind === "refused") status(`refused: ${m.reason}`);
  else if (m.kind === "error") status(`error: ${m.message}`);
}
function trainingText(info) {
  const written = info.capture_state === "merged" ? "the run has finished" : "the run is writing";
  const follow = info.following ? `following the run (${written}): ${info.steps} steps so far${info.last_step === null ? "" : ` (last step ${info.last_step})`}; ` : "";
  return `${follow}dropped records in this capture: ${info.dropped_records}; captured rows: ${info.rows}; steps: ${info.steps}`;
}
function onTraining(m) { // a followed run wrote more statistics: refresh the training view
  Object.assign(state.info, m); state.trainingUpdates += 1;
  fillSelect($("t-site"), Object.keys(m.series)); // keeps the chosen site and statistic
  $("dropped").textContent = trainingText(state.info);
  onTrainingSite();
}
function send(obj) { if (state.ws && state.ws.readyState === WebSocket.OPEN) state.ws.send(JSON.stringify(obj)); }
function connect() {
  const token = new URLSearchParams(location.search).get("token") || "";
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws?token=${encodeURIComponent(token)}`);
  ws.binaryType = "arraybuffer";
  ws.onmessage = onMessage;
  ws.onclose = () => status("disconnected (reload the page with the URL the server printed)");
  state.ws = ws;
}

// ---------------------------------------------------------------- controls
const PERTURB_FIELDS = { act_noise: ["f-site", "f-sigma"], act_offset: ["f-site", "f-value"], head_mask: ["f-head"] };
function showPerturbFields() { // only the fields the chosen kind uses
  const used = PERTURB_FIELDS[$("p-kind").value];
  for (const id of ["f-site", "f-sigma", "f-value", "f-head"]) $(id).hidden = !used.includes(id);
}
function perturbation() {
  if (!$("use-perturb").checked) return undefined;
  const kind = $("p-kind").value, p = { kind, layer: Number($("p-layer").value) };
  if (kind === "head_mask") p.heads = [Number($("p-head").value)];
  else p.site = $("p-site").value;
  if (kind === "act_noise") p.sigma = Number($("p-sigma").value);
  if (kind === "act_offset") p.value = Number($("p-value").value);
  return p;
}
function onStatSite() {
  const rec = state.steps[0];
  if (!rec) return;
  const site = $("stat-site").value;
  fillSelect($("stat-name"), Object.keys(rec.arrays).filter((n) => n.startsWith(`clean/stats/${site}/`)).map((n) => n.split("/")[3]));
  renderStats();
}
function onTrainingSite() {
  const site = $("t-site").value;
  fillSelect($("t-stat"), (state.info && state.info.series[site]) || []);
  requestSeries();
}
function requestSeries() {
  if ($("t-site").value && $("t-stat").value) send({ type: "series", site: $("t-site").value, stat: $("t-stat").value });
}
function setStep(i) { state.sel.step = Math.max(0, Math.min(i, state.steps.length - 1)); renderAll(); }
function replay() {
  if (state.playing) { clearInterval(state.playing); state.playing = null; $("play").textContent = "Replay"; return; }
  $("follow").checked = false; setStep(0); $("play").textContent = "Pause";
  state.playing = setInterval(() => {
    if (state.sel.step >= state.steps.length - 1) return replay();
    setStep(state.sel.step + 1);
  }, 250);
}
function wire() {
  $("gen-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.steps = []; state.latencies = []; state.shown = []; state.done = false; state.sel.step = 0; state.topkOpen = false; state.target = "a";
    $("prompt").dataset.sent = $("prompt").value;
    const msg = { type: "generate", prompt: $("prompt").value, tokens: Number($("ntokens").value), top_k: Number($("topk-n").value) };
    const p = perturbation(); if (p) msg.perturb = p;
    state.perturbSent = p || null;
    renderAll(); status("decoding…"); send(msg);
  });
  $("stop").addEventListener("click", () => send({ type: "stop" }));
  $("gen-b-form").addEventListener("submit", (e) => { // a second prompt, same settings, for comparison
    e.preventDefault();
    state.stepsB = []; state.doneB = false; state.target = "b"; state.promptB = $("prompt-b").value;
    renderAttention(); status("decoding prompt B…");
    send({ type: "generate", prompt: state.promptB, tokens: Number($("ntokens").value), top_k: Number($("topk-n").value) });
  });
  $("tokens").addEventListener("click", (e) => {
    const t = e.target.closest(".tok"); if (!t) return;
    const i = Number(t.dataset.step);
    state.topkOpen = !(state.topkOpen && state.sel.step === i);
    $("follow").checked = false; setStep(i);
  });
  $("tokens-perturbed").addEventListener("click", (e) => { const t = e.target.closest(".tok"); if (t) { $("follow").checked = false; setStep(Number(t.dataset.step)); } });
  $("timeline").addEventListener("input", (e) => { $("follow").checked = false; setStep(Number(e.target.value)); });
  $("q-token").addEventListener("input", (e) => { state.sel.token = Number(e.target.value); renderAll(); });
  $("q-layer").addEventListener("change", (e) => { state.sel.layer = Number(e.target.value); renderAll(); });
  $("q-head").addEventListener("change", (e) => { state.sel.head = Number(e.target.value); renderAll(); });
  $("play").addEventListener("click", replay);
  $("p-kind").addEventListener("change", showPerturbFields);
  $("attn-grid-of").addEventListener("change", renderAttention);
  $("attn-diff-of").addEventListener("change", renderAttention);
  $("attn-grid").addEventListener("click", (e) => { // a small map: enlarge it below
    const c = e.target.closest("canvas.mini"); if (!c) return;
    state.sel.layer = Number(c.dataset.layer); state.sel.head = Number(c.dataset.head);
    $("q-layer").value = c.dataset.layer; $("q-head").value = c.dataset.head;
    renderAll(); $("attn-enlarged").scrollIntoView({ block: "start" });
  });
  $("lens-of").addEventListener("change", renderLens);
  $("patch-of").addEventListener("change", renderPatching);
  $("dla-of").addEventListener("change", renderDla);
  $("stat-site").addEventListener("change", onStatSite);
  $("stat-name").addEventListener("change", renderStats);
  $("t-site").addEventListener("change", onTrainingSite);
  $("t-stat").addEventListener("change", requestSeries);
  for (const b of document.querySelectorAll("#tabs button")) b.addEventListener("click", () => {
    for (const o of document.querySelectorAll("#tabs button, .tab")) o.classList.remove("active");
    b.classList.add("active"); $(`tab-${b.dataset.tab}`).classList.add("active");
    VIEWS[b.dataset.tab]();
  });
  renderAll(); renderTraining();
}
wire();
connect();
