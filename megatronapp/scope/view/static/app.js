// MegaScope view: plain JS, no dependencies. Talks to the server over one
// websocket (token from this page's URL); arrays arrive as binary frames.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  info: null, steps: [], latencies: [], shown: [], series: null, ws: null, playing: null,
  stepsB: [], promptB: "", target: "a", doneB: false, trainingUpdates: 0,
  sel: { layer: 1, head: 0, token: -1, step: 0 }, topkOpen: false,
};
window.megascope = state; // read by the browser test and the latency benchmark

// ---------------------------------------------------------------- colours
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(t) {
  if (!Number.isFinite(t)) return [220, 220, 220];
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
}
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"];
const fmt = (v) => Number.isInteger(v) ? String(v) : (Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0)) ? v.toExponential(2) : v.toFixed(3);
const UNITS = { entropy: "nats", prev_token_mass: "share of attention", sink_mass: "share of attention", sparsity: "share", nan_count: "count", inf_count: "count", kurtosis: "excess, no unit" };
const unit = (stat) => UNITS[stat.split("(")[0]] || "tensor units";
const show = (c) => JSON.stringify(c).slice(1, -1) || " ";

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
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "12px system-ui, sans-serif"; ctx.fillStyle = "#222"; ctx.strokeStyle = "#222";
  return ctx;
}
function message(canvas, text) {
  const ctx = clear(canvas);
  ctx.fillStyle = "#777"; ctx.fillText(text, 20, 30);
}
function range(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (lo === Infinity) return [0, 1];
  return lo === hi ? [lo - 0.5, hi + 0.5] : [lo, hi];
}
function legend(ctx, x, y, h, lo, hi, title) {
  for (let i = 0; i < h; i++) {
    const [r, g, b] = colour(1 - i / (h - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`; ctx.fillRect(x, y + i, 14, 1);
  }
  ctx.fillStyle = "#222"; ctx.strokeRect(x, y, 14, h);
  ctx.fillText(fmt(hi), x + 18, y + 8); ctx.fillText(fmt(lo), x + 18, y + h);
  ctx.save(); ctx.translate(x + 70, y + h / 2); ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center"; ctx.fillText(title, 0, 0); ctx.restore();
}
function axisTitles(ctx, box, xtitle, ytitle) {
  ctx.fillStyle = "#222"; ctx.textAlign = "center";
  ctx.fillText(xtitle, box.x + box.w / 2, box.y + box.h + 34);
  ctx.save(); ctx.translate(14, box.y + box.h / 2); ctx.rotate(-Math.PI / 2);
  ctx.fillText(ytitle, 0, 0); ctx.restore(); ctx.textAlign = "left";
}
// m: {rows, cols, at}; o: {xlabels, ylabels, xtitle, ytitle, title, lo, hi, mark: {row, col}}
function heatmap(canvas, m, o) {
  const ctx = clear(canvas);
  const box = { x: 70, y: 24, w: canvas.width - 190, h: canvas.height - 70 };
  const cw = box.w / m.cols, ch = box.h / m.rows;
  const vals = []; for (let r = 0; r < m.rows; r++) for (let c = 0; c < m.cols; c++) vals.push(m.at(r, c));
  const [lo, hi] = o.lo !== undefined ? [o.lo, o.hi] : range(vals);
  for (let r = 0; r < m.rows; r++) for (let c = 0; c < m.cols; c++) {
    const [R, G, B] = colour((m.at(r, c) - lo) / (hi - lo));
    ctx.fillStyle = `rgb(${R},${G},${B})`;
    ctx.fillRect(box.x + c * cw, box.y + r * ch, Math.ceil(cw), Math.ceil(ch));
  }
  ctx.strokeStyle = "#222"; ctx.strokeRect(box.x, box.y, box.w, box.h);
  if (o.mark && o.mark.row >= 0) {
    ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2;
    ctx.strokeRect(box.x, box.y + o.mark.row * ch, box.w, ch); ctx.lineWidth = 1;
  }
  ctx.fillStyle = "#222";
  const every = (n, px) => Math.max(1, Math.ceil(n / Math.max(1, px / 14)));
  const sx = every(m.cols, box.w), sy = every(m.rows, box.h);
  ctx.textAlign = "center";
  for (let c = 0; c < m.cols; c += sx) ctx.fillText(o.xlabels ? o.xlabels(c) : c, box.x + (c + .5) * cw, box.y + box.h + 14);
  ctx.textAlign = "right";
  for (let r = 0; r < m.rows; r += sy) ctx.fillText(o.ylabels ? o.ylabels(r) : r, box.x - 4, box.y + (r + .5) * ch + 4);
  ctx.textAlign = "left";
  if (o.title) ctx.fillText(o.title, box.x, 14);
  axisTitles(ctx, box, o.xtitle, o.ytitle);
  legend(ctx, box.x + box.w + 20, box.y, box.h, lo, hi, o.legend);
}
function plotBox(canvas) { return { x: 70, y: 24, w: canvas.width - 240, h: canvas.height - 70 }; }
function axes(ctx, box, [x0, x1], [y0, y1]) {
  ctx.strokeStyle = "#222"; ctx.strokeRect(box.x, box.y, box.w, box.h); ctx.fillStyle = "#222";
  for (let i = 0; i <= 4; i++) {
    const xv = x0 + (x1 - x0) * i / 4, yv = y0 + (y1 - y0) * i / 4;
    ctx.textAlign = "center"; ctx.fillText(fmt(xv), box.x + box.w * i / 4, box.y + box.h + 14);
    ctx.textAlign = "right"; ctx.fillText(fmt(yv), box.x - 4, box.y + box.h - box.h * i / 4 + 4);
  }
  ctx.textAlign = "left";
  return { px: (x) => box.x + (x - x0) / (x1 - x0) * box.w, py: (y) => box.y + box.h - (y - y0) / (y1 - y0) * box.h };
}
function keyOf(ctx, box, names) {
  names.forEach(([name, colr], i) => {
    ctx.fillStyle = colr; ctx.fillRect(box.x + box.w + 14, box.y + 6 + i * 18, 12, 12);
    ctx.fillStyle = "#222"; ctx.fillText(name, box.x + box.w + 30, box.y + 16 + i * 18);
  });
}
// lines: [{name, xs, ys, colour}]
function lineChart(canvas, lines, o) {
  const ctx = clear(canvas), box = plotBox(canvas);
  const xr = range(lines.flatMap((l) => l.xs)), yr = range(lines.flatMap((l) => l.ys));
  if (o.zero) yr[0] = Math.min(0, yr[0]);
  const { px, py } = axes(ctx, box, xr, yr);
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
  if (o.markX !== undefined) {
    ctx.strokeStyle = "#999"; ctx.beginPath(); ctx.moveTo(px(o.markX), box.y); ctx.lineTo(px(o.markX), box.y + box.h); ctx.stroke();
  }
  ctx.fillStyle = "#222"; if (o.title) ctx.fillText(o.title, box.x, 14);
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
function renderTokens() {
  const box = $("tokens"), pbox = $("tokens-perturbed");
  const first = state.steps[0];
  if (!first) { box.replaceChildren(); pbox.replaceChildren(); return; }
  const prompt = $("prompt").dataset.sent || "";
  const spans = (which) => state.steps.map((rec, i) => {
    const v = rec.header[which]; const s = document.createElement("span");
    s.className = "tok" + (i === state.sel.step ? " selected" : ""); s.dataset.step = i;
    s.title = `step ${i}: ${show(v.token)} p=${v.prob.toFixed(3)}`;
    s.style.backgroundColor = `rgba(31,119,180,${(0.1 + 0.6 * v.prob).toFixed(2)})`;
    const p = document.createElement("span"); p.className = "prob"; p.textContent = v.prob.toFixed(2);
    s.append(v.token, p);
    return s;
  });
  const label = (t) => { const l = document.createElement("span"); l.className = "label"; l.textContent = t; return l; };
  const pr = document.createElement("span"); pr.className = "prompt"; pr.textContent = prompt;
  box.replaceChildren(label(first.header.perturbed ? "clean" : "text"), pr, ...spans("clean"));
  if (first.header.perturbed) {
    const pr2 = pr.cloneNode(true);
    pbox.replaceChildren(label("perturbed"), pr2, ...spans("perturbed"));
  } else pbox.replaceChildren();
}
function renderTopk() {
  const panel = $("topk-panel"), rec = current();
  panel.hidden = !state.topkOpen || !rec;
  if (panel.hidden) return;
  const svg = $("topk"), NS = "http://www.w3.org/2000/svg";
  const el = (name, attrs, text) => { const e = document.createElementNS(NS, name); for (const k in attrs) e.setAttribute(k, attrs[k]); if (text !== undefined) e.textContent = text; return e; };
  const top = rec.header.clean.topk, W = 520, left = 80, bar = 22, width = W - left - 70;
  svg.setAttribute("height", 50 + top.length * bar);
  const kids = [el("text", { x: left, y: 14 }, `step ${state.sel.step}: next-token probability (top ${top.length})`)];
  top.forEach((t, i) => {
    const y = 24 + i * bar;
    kids.push(el("text", { x: left - 6, y: y + 15, "text-anchor": "end", "font-family": "monospace" }, show(t.token)));
    kids.push(el("rect", { x: left, y, width: Math.max(1, t.prob * width), height: bar - 4, fill: t.token_id === rec.header.clean.token_id ? "#d62728" : "#1f77b4", class: "topk-bar" }));
    kids.push(el("text", { x: left + t.prob * width + 4, y: y + 15 }, t.prob.toFixed(3)));
  });
  const yAxis = 24 + top.length * bar;
  kids.push(el("line", { x1: left, x2: left + width, y1: yAxis, y2: yAxis, stroke: "#222" }));
  kids.push(el("text", { x: left, y: yAxis + 14 }, "0"), el("text", { x: left + width, y: yAxis + 14, "text-anchor": "end" }, "1"));
  kids.push(el("text", { x: left + width / 2, y: yAxis + 20, "text-anchor": "middle" }, "probability"));
  svg.replaceChildren(...kids);
  $("topk-title").textContent = `top-${top.length} after ${show(rec.header.window.slice(-1)[0] || "")}`;
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
function attentionMap(canvas, rec, which, step) {
  const a = rec.arrays[`${which}/attention/layer${state.sel.layer}`];
  if (!a) { message(canvas, "no attention at this layer"); return false; }
  const win = rec.header.window, tok = (i) => show(win[i]);
  heatmap(canvas, matrix(a, [state.sel.head]), { xlabels: tok, ylabels: tok, xtitle: "key token", ytitle: "query token", title: `layer ${state.sel.layer}, head ${state.sel.head}, step ${step}`, legend: "attention probability", lo: 0, hi: 1, mark: { row: selectedToken(rec) } });
  return true;
}
function renderAttention() {
  const rec = current();
  $("attn-prompt-a").textContent = show($("prompt").dataset.sent || "");
  if (!rec) { message($("attn-canvas"), "no step yet"); } else {
    attentionMap($("attn-canvas"), rec, "clean", state.sel.step);
    $("attn-perturbed-fig").hidden = !attentionMap($("attn-canvas-p"), rec, "perturbed", state.sel.step);
  }
  // prompt B: the same layer, head and step (its last step when it is shorter)
  $("attn-b-fig").hidden = !state.stepsB.length;
  if (!state.stepsB.length) return;
  const stepB = Math.min(state.sel.step, state.stepsB.length - 1);
  $("attn-prompt-b").textContent = show(state.promptB);
  attentionMap($("attn-canvas-b"), state.stepsB[stepB], "clean", stepB);
}
function pcaRange() { // one range over every step and layer: the basis is fixed
  const xs = [], ys = [];
  for (const rec of state.steps) for (const [name, a] of Object.entries(rec.arrays)) {
    if (!name.includes("/pca/")) continue;
    for (let i = 0; i < a.data.length; i += 2) { xs.push(a.data[i]); ys.push(a.data[i + 1]); }
  }
  return [range(xs), range(ys)];
}
function renderPca() {
  const canvas = $("pca-canvas"), rec = current();
  if (!rec) { message(canvas, "no step yet"); return; }
  const ctx = clear(canvas), box = plotBox(canvas), [xr, yr] = pcaRange();
  const { px, py } = axes(ctx, box, xr, yr), keys = [];
  const sel = selectedToken(rec);
  [["clean", "#1f77b4"], ["perturbed", "#d62728"]].forEach(([which, colr]) => {
    const a = rec.arrays[`${which}/pca/layer${state.sel.layer}`];
    if (!a) return;
    keys.push([`${which} tokens`, colr]);
    ctx.strokeStyle = colr; ctx.globalAlpha = 0.4; ctx.beginPath();
    for (let i = 0; i < a.shape[0]; i++) (i ? ctx.lineTo : ctx.moveTo).call(ctx, px(a.data[2 * i]), py(a.data[2 * i + 1]));
    ctx.stroke(); ctx.globalAlpha = 1; ctx.fillStyle = colr;
    for (let i = 0; i < a.shape[0]; i++) {
      ctx.beginPath(); ctx.arc(px(a.data[2 * i]), py(a.data[2 * i + 1]), i === sel ? 6 : 3, 0, 2 * Math.PI); ctx.fill();
    }
  });
  const last = state.steps.slice(0, state.sel.step + 1).map((r) => r.arrays[`clean/pca/layer${state.sel.layer}`]).filter(Boolean);
  ctx.strokeStyle = "#2ca02c"; ctx.lineWidth = 2; ctx.beginPath();
  last.forEach((a, i) => { const n = a.shape[0] - 1; (i ? ctx.lineTo : ctx.moveTo).call(ctx, px(a.data[2 * n]), py(a.data[2 * n + 1])); });
  ctx.stroke(); ctx.lineWidth = 1;
  keys.push(["last token, steps", "#2ca02c"]);
  ctx.fillStyle = "#222";
  ctx.fillText(`layer ${state.sel.layer}, step ${state.sel.step}; selected token ${show(rec.header.window[sel])} (large dot)`, box.x, 14);
  axisTitles(ctx, box, "PC 1 (fixed basis, hidden-state units)", "PC 2");
  keyOf(ctx, box, keys);
}
function renderPerturbation() {
  const withP = state.steps.filter((r) => r.header.perturbed);
  if (!withP.length) { message($("kl-canvas"), "no perturbed generation yet: tick 'perturb' and generate"); message($("dh-canvas"), ""); return; }
  lineChart($("kl-canvas"), [{ name: "KL(clean‖perturbed)", xs: withP.map((r) => r.header.step), ys: withP.map((r) => r.header.kl), colour: "#d62728" }], { xtitle: "decoding step", ytitle: "KL (nats)", title: "KL divergence of the next-token distributions per step", markX: state.sel.step, zero: true });
  const dh = (current() || withP[0]).header.delta_h || {};
  const layers = Object.keys(dh).map(Number).sort((a, b) => a - b);
  lineChart($("dh-canvas"), [{ name: "‖Δh‖/‖h‖", xs: layers, ys: layers.map((l) => dh[l]), colour: "#9467bd" }], { xtitle: "layer", ytitle: "‖Δh‖/‖h‖ (ratio)", title: `relative change of the last token's hidden state per layer, step ${state.sel.step}`, zero: true });
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
const VIEWS = { generation: renderTopk, tensors: renderStats, attention: renderAttention, pca: renderPca, perturbation: renderPerturbation, training: renderTraining };
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
