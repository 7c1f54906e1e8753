// Loadmaster dashboard: polls /api/dashboard every second and draws plain canvas charts.
// No dependencies; every chart records what it drew in data-* attributes (points, series).
"use strict";

const PALETTE = ["#4e9af1", "#f5a623", "#50c878", "#e0525a", "#b07cf2", "#2ec4c4", "#f07ab5", "#c7c94d"];
const PERCENTILE_COLORS = { p50: "#50c878", p95: "#f5a623", p99: "#e0525a" };
const REFRESH_MS = 1000;
// ?window_s=30&step_s=1&summary_s=10 on the page's address are passed on to the data endpoint.
const QUERY = new URLSearchParams(location.search);
const DATA_URL = "/api/dashboard" + (QUERY.toString() ? `?${QUERY}` : "");
let updates = 0;

function colorFor(index) { return PALETTE[index % PALETTE.length]; }

function niceMax(value) {
  if (!(value > 0)) return 1;
  const exp = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * exp >= value) return step * exp;
  return 10 * exp;
}

function format(value) {
  if (value === null || value === undefined) return "–";
  if (Number.isInteger(value)) return String(value);
  if (Math.abs(value) >= 100) return value.toFixed(0);
  if (Math.abs(value) >= 10) return value.toFixed(1);
  return value.toFixed(2);
}

// series: [{name, color, values}], t: seconds relative to now (same length as values)
function drawChart(canvas, t, series) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400, height = canvas.clientHeight || 170;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const left = 46, right = 8, top = 18, bottom = 18;
  const plotW = width - left - right, plotH = height - top - bottom;
  let max = 0, points = 0;
  for (const s of series) for (const v of s.values) if (v !== null && v !== undefined) { max = Math.max(max, v); points++; }
  const yMax = niceMax(max * 1.05);
  ctx.font = "10px system-ui, sans-serif";
  ctx.strokeStyle = "#2a3440"; ctx.fillStyle = "#7d8a99"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.textAlign = "right"; ctx.fillText(format((yMax * i) / 4), left - 4, y + 3);
  }
  const t0 = t.length ? t[0] : -1, t1 = t.length ? t[t.length - 1] : 0;
  const xOf = (x) => left + (plotW * (x - t0)) / Math.max(1e-9, t1 - t0);
  ctx.textAlign = "center";
  for (const mark of [t0, (t0 + t1) / 2, t1]) ctx.fillText(`${Math.round(mark)} s`, xOf(mark), height - 4);
  series.forEach((s) => {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.6; ctx.beginPath();
    let drawing = false, lone = null;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { drawing = false; return; }
      const x = xOf(t[i]), y = top + plotH - (plotH * v) / yMax;
      if (drawing) ctx.lineTo(x, y); else { ctx.moveTo(x, y); lone = [x, y]; }
      drawing = true;
    });
    ctx.stroke();
    if (lone) { ctx.fillStyle = s.color; ctx.fillRect(lone[0] - 1.5, lone[1] - 1.5, 3, 3); }
  });
  let x = left;
  ctx.textAlign = "left";
  for (const s of series) {
    ctx.fillStyle = s.color; ctx.fillRect(x, 4, 10, 8);
    ctx.fillStyle = "#d8dee6"; ctx.fillText(s.name, x + 13, 12);
    x += 20 + ctx.measureText(s.name).width;
  }
  if (!series.length) { ctx.fillStyle = "#7d8a99"; ctx.textAlign = "center"; ctx.fillText("no data yet", left + plotW / 2, top + plotH / 2); }
  canvas.dataset.points = String(points);
  canvas.dataset.series = series.map((s) => s.name).join(",");
  canvas.dataset.max = String(max);
}

function perModel(models, key) {
  return Object.keys(models).map((name, i) => ({ name, color: colorFor(i), values: models[name][key] }));
}

function latencyCharts(doc) {
  const holder = document.getElementById("latency");
  const names = Object.keys(doc.models);
  for (const figure of [...holder.children]) if (!names.includes(figure.dataset.model)) figure.remove();
  names.forEach((name) => {
    let figure = holder.querySelector(`figure[data-model="${CSS.escape(name)}"]`);
    if (!figure) {
      figure = document.createElement("figure");
      figure.dataset.model = name;
      figure.innerHTML = `<figcaption></figcaption><canvas class="chart latency" data-unit="ms"></canvas>`;
      figure.querySelector("canvas").id = `chart-latency-${name}`;
      holder.appendChild(figure);
    }
    const m = doc.models[name];
    figure.querySelector("figcaption").textContent = `${name} · p99 ${format(m.summary.p99_ms)} ms`;
    drawChart(figure.querySelector("canvas"), doc.t,
      ["p50", "p95", "p99"].map((p) => ({ name: p, color: PERCENTILE_COLORS[p], values: m[p] })));
  });
}

function cell(row, text, className) {
  const td = row.insertCell(); td.textContent = text; if (className) td.className = className; return td;
}

function summaryTable(doc) {
  const body = document.querySelector("#summary tbody");
  body.replaceChildren();
  Object.keys(doc.models).forEach((name, i) => {
    const s = doc.models[name].summary, row = body.insertRow();
    row.dataset.model = name;
    cell(row, name).style.color = colorFor(i);
    for (const key of ["p50_ms", "p95_ms", "p99_ms", "throughput_rps", "queue_depth", "deadline_misses", "errors"]) {
      cell(row, format(s[key])).dataset.key = key;
    }
  });
}

function workersTable(doc) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const worker of doc.workers) {
    for (const slot of worker.slots) {
      const row = body.insertRow();
      row.dataset.worker = worker.worker_id; row.dataset.model = slot.model; row.dataset.state = slot.state;
      cell(row, worker.worker_id); cell(row, slot.model);
      const state = document.createElement("span");
      state.className = `state state-${slot.state}`; state.textContent = slot.state;
      row.insertCell().appendChild(state);
      cell(row, String(slot.inflight)); cell(row, String(slot.vram_mb));
    }
  }
}

function render(doc) {
  document.getElementById("window").textContent = doc.window_s;
  document.getElementById("summary-window").textContent = doc.summary_s;
  summaryTable(doc);
  drawChart(document.getElementById("chart-throughput"), doc.t, perModel(doc.models, "throughput_rps"));
  drawChart(document.getElementById("chart-queue"), doc.t, perModel(doc.models, "queue_depth"));
  drawChart(document.getElementById("chart-misses"), doc.t, perModel(doc.models, "deadline_misses_per_s"));
  drawChart(document.getElementById("chart-gpu"), doc.t, Object.keys(doc.gpus).map((gpu, i) => ({
    name: `${gpu} (free ${format(doc.gpus[gpu].free_mb_now)})`, color: colorFor(i), values: doc.gpus[gpu].lease_mb || [],
  })));
  const generative = doc.generative || {};
  drawChart(document.getElementById("chart-tokens"), doc.t, perModel(generative, "tokens_per_s"));
  drawChart(document.getElementById("chart-ttft"), doc.t, perModel(generative, "ttft_p50_ms"));
  latencyCharts(doc);
  workersTable(doc);
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch(DATA_URL, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}: ${await response.text()}`);
    render(await response.json());
    updates++;
    document.body.dataset.updates = String(updates);
    status.textContent = `live · ${new Date().toLocaleTimeString()}`;
    status.className = "status ok";
  } catch (error) {
    status.textContent = `metrics service unreachable (${error.message})`;
    status.className = "status down";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
