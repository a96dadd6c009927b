// The epd-serve status page: polls dashboard/state and redraws the tables and charts.
// No dependencies: the DOM and SVG only. An API key typed in the form is kept for this tab
// (sessionStorage) and sent as a bearer token, which makes the gateway show worker addresses.
"use strict";

const KEY_STORE = "epd-dashboard-key";
let period = 2000;
let timer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits ?? 0 });
}

// Three significant digits, however small (a chart's maximum: 0.000412 GB/s, 1,190 ms).
function sig(value) {
  const v = Number(value);
  return v === 0 || Math.abs(v) >= 100 ? fmt(v, 0) : Number(v.toPrecision(3)).toString();
}

function usage(part) {
  if (!part || !part.total) return "–";
  const bar = el("span", { class: "bar" }, el("b"));
  bar.firstChild.style.width = `${Math.min(100, (100 * part.used) / part.total).toFixed(1)}%`;
  const cell = el("span");
  cell.append(bar, `${fmt(part.used)} / ${fmt(part.total)}`);
  return cell;
}

function ago(seconds) {
  return seconds < 1 ? "now" : `${fmt(seconds, 1)} s ago`;
}

function healthCell(state) {
  return el("td", { class: "health" }, el("span", {}, state));
}

function workerRow(worker, cells) {
  const row = el("tr", { class: "worker", "data-id": worker.id, "data-role": worker.role,
    "data-state": worker.state });
  const name = el("td", { class: "name" }, worker.id);
  if (worker.model) name.title = `model ${worker.model}`;
  row.append(name, healthCell(worker.state), el("td", {}, fmt(worker.in_flight)));
  for (const cell of cells) row.append(el("td", {}, cell));
  row.append(el("td", {}, ago(worker.last_seen_s)), el("td", { class: "note" }, worker.problem || ""));
  return row;
}

function encoderRow(w) {
  const cache = w.cache ? `${fmt(w.cache.hits)} / ${fmt(w.cache.hits + w.cache.misses)}` : "–";
  const video = w.video ? `${fmt(w.video.frames)} (${fmt(w.video.decode_s, 1)})` : "–";
  return workerRow(w, [fmt(w.queue.requests), fmt(w.queue.images),
    fmt(w.queue.waiting_for_blocks), usage(w.blocks), cache, video]);
}

function languageRow(w) {
  return workerRow(w, [fmt(w.queue.running), fmt(w.queue.waiting), fmt(w.queue.receiving),
    usage(w.blocks), usage(w.kv)]);
}

function fillTable(id, rows) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...(rows.length ? rows
    : [el("tr", { class: "empty" }, el("td", { colspan: "11", class: "muted" }, "no workers"))]));
}

function svgNode(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

// A small line chart of `series` (arrays of numbers or null, one per sample) in the SVG `id`.
function chart(id, series, times) {
  const svg = document.getElementById(id);
  const values = series.flatMap((s) => s.filter((v) => v !== null));
  const top = Math.max(1e-9, ...values) * 1.1;
  const n = Math.max(times.length - 1, 1);
  const shapes = [];
  series.forEach((s, k) => {
    const points = [];
    s.forEach((v, i) => {
      if (v === null) return;
      const [x, y] = [((300 * i) / n).toFixed(1), (90 - (90 * v) / top).toFixed(1)];
      points.push(`${x},${y}`);
      if (s[i - 1] == null && s[i + 1] == null) {  // a lone point: a dot, or it would not show
        const dot = svgNode("circle", { class: `s${k}`, cx: x, cy: y, r: "1.5" });
        shapes.push(dot);
      }
    });
    shapes.push(svgNode("polyline", { class: `s${k}`, points: points.join(" ") }));
  });
  svg.replaceChildren(...shapes);
  const axis = document.getElementById(id.replace("chart", "axis"));
  const span = times.length > 1 ? (times[times.length - 1] - times[0]) / 60 : 0;
  axis.replaceChildren(el("span", {}, `-${fmt(span, 1)} min`),
    el("span", {}, `max ${sig(values.length ? Math.max(...values) : 0)}`), el("span", {}, "now"));
}

function render(state) {
  const workers = state.workers;
  fillTable("encoders", workers.filter((w) => w.role === "encoder").map(encoderRow));
  fillTable("languages", workers.filter((w) => w.role === "language").map(languageRow));
  for (const role of ["encoder", "language"]) {
    const pool = state.pools[role];
    document.getElementById(`pool-${role}`).textContent = `${pool.healthy} of ${pool.total} healthy`;
  }
  const s = state.series;
  const times = s.map((p) => p.t);
  chart("chart-requests", [s.map((p) => p.requests_per_s.grpc), s.map((p) => p.requests_per_s.http),
    s.map((p) => p.errors_per_s)], times);
  chart("chart-ttft", [s.map((p) => p.ttft_p50_ms), s.map((p) => p.ttft_p99_ms)], times);
  chart("chart-transfer", [s.map((p) => p.transfer_gb_s)], times);
  const last = s.length ? s[s.length - 1] : null;
  const rps = last ? last.requests_per_s.grpc + last.requests_per_s.http : 0;
  document.getElementById("summary").textContent = `${fmt(state.in_flight)} in flight · ` +
    `${fmt(rps, 2)} req/s · up ${fmt(state.uptime_s / 60, 1)} min` +
    (state.show_addresses ? "" : " · addresses hidden");
  document.getElementById("period").textContent = fmt(state.sample_s, 1);
  document.getElementById("history").textContent = fmt(state.history_s / 60, 1);
  document.body.dataset.updated = String(state.now);
  period = Math.max(500, state.sample_s * 1000);
}

async function refresh() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY_STORE);
  const error = document.getElementById("error");
  try {
    const reply = await fetch("dashboard/state", {
      headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store" });
    if (!reply.ok) throw new Error(`dashboard/state answered ${reply.status}`);
    render(await reply.json());
    error.hidden = true;
  } catch (exc) {
    error.textContent = `cannot reach the gateway: ${exc.message}`;
    error.hidden = false;
  }
  timer = setTimeout(refresh, period);
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key); else sessionStorage.removeItem(KEY_STORE);
    refresh();
  });
  refresh();
});
