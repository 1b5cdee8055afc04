// The live monitor: reads /stats about once a second and draws it.

import { describeError, getJSON, takeKeyFromUrl } from "../api.js";
import { TimeChart } from "./chart.js";

const $ = (id) => document.getElementById(id);
const INTERVAL_MS = 1000;
const charts = { decode: new TimeChart($("decode-chart")), prefill: new TimeChart($("prefill-chart")) };
let lastOk = 0;

// ---- formatting ---------------------------------------------------------------------------

const int = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));

function rate(tps) {
  if (tps == null || !Number.isFinite(tps)) return "–";
  return tps >= 100 ? Math.round(tps).toLocaleString("en-US") : tps.toFixed(1);
}

function ms(v) {
  if (v == null || !Number.isFinite(v)) return "–";
  return v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(2)} s`;
}

function bytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
}

function duration(s) {
  if (s == null) return "";
  const d = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  return d ? `${d} d ${h} h` : h ? `${h} h ${m} min` : m ? `${m} min` : `${Math.floor(s)} s`;
}

function ago(endedAt) {
  const s = Math.max(0, Date.now() / 1000 - endedAt);
  return s < 60 ? `${Math.round(s)} s ago` : s < 3600 ? `${Math.round(s / 60)} min ago`
    : new Date(endedAt * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
}

function setText(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}

function meter(id, used, total, label) {
  const el = $(id);
  const frac = total > 0 ? Math.min(1, used / total) : 0;
  el.querySelector(".meter-value").textContent = total > 0 ? label : "–";
  el.querySelector(".bar > i").style.width = `${(frac * 100).toFixed(1)}%`;
  el.classList.toggle("high", frac > 0.9);
}

// ---- sections -----------------------------------------------------------------------------

function renderThroughput(s) {
  const t = s.throughput || {};
  for (const kind of ["decode", "prefill"]) {
    const key = `${kind}_tps`;
    setText(`${kind}-now`, rate(t["1s"]?.[key]));
    setText(`${kind}-10s`, rate(t["10s"]?.[key]));
    setText(`${kind}-60s`, rate(t["60s"]?.[key]));
    charts[kind].push(performance.now() / 1000, t["1s"]?.[key] ?? 0);
  }
}

function renderRequests(s) {
  const r = s.requests || {};
  setText("running", int(r.running));
  setText("waiting", int(r.waiting));
  setText("paused", int(r.paused));
  const p = s.preemptions || {};
  setText("preemptions", `${int(p.snapshot)} to host memory · ${int(p.replay)} recomputed · ${int(p.restored)} restored`);
  setText("ttft-last", ms(s.ttft_ms?.last));
  setText("ttft-p50", ms(s.ttft_ms?.p50_60s));
}

function renderMemory(s) {
  const m = s.memory || {};
  const pageTokens = m.kv_page_size ? ` · ${int(m.kv_pages_used * m.kv_page_size)} tokens` : "";
  meter("kv-meter", m.kv_pages_used, m.kv_pages_total, `${int(m.kv_pages_used)} / ${int(m.kv_pages_total)}${pageTokens}`);
  meter("slots-meter", m.state_slots_used, m.state_slots_total, `${int(m.state_slots_used)} / ${int(m.state_slots_total)}`);
  meter("host-meter", m.host_cache_bytes_used, m.host_cache_bytes_total,
        `${bytes(m.host_cache_bytes_used)} / ${bytes(m.host_cache_bytes_total)}`);
  const c = s.cache || {};
  setText("cache-hit", int(c.cached_tokens_total));
  setText("cache-rate", c.prompt_tokens_total ? `${((100 * c.cached_tokens_total) / c.prompt_tokens_total).toFixed(1)}%` : "–");
  const hits = c.hits || {};
  setText("cache-hits-gpu", int(hits.gpu));
  setText("cache-hits-host", int(hits.host));
  setText("cache-kept-gpu", c.checkpoints_max ? `${int(c.checkpoints)} / ${int(c.checkpoints_max)}` : "–");
  const hostBytes = (c.host_checkpoint_kv_bytes || 0) + (c.host_checkpoint_state_bytes || 0);
  setText("cache-kept-host", c.host_checkpoints ? `${int(c.host_checkpoints)} · ${bytes(hostBytes)}` : int(c.host_checkpoints));
}

function renderSpeculative(s) {
  const spec = s.speculative || {};
  const bars = $("spec-bars");
  $("spec-card").classList.toggle("off", !spec.enabled);
  if (!spec.enabled) {
    setText("spec-summary", "off");
    bars.replaceChildren();
    return;
  }
  const rate = spec.drafted ? `${((100 * spec.accepted) / spec.drafted).toFixed(1)}%` : "–";
  setText("spec-summary", `${int(spec.accepted)} of ${int(spec.drafted)} drafted tokens accepted (${rate})`);
  const by = spec.acceptance_by_position || [];
  if (bars.children.length !== by.length) {
    bars.replaceChildren(...by.map((_, i) => {
      const col = document.createElement("div");
      col.className = "acc";
      col.innerHTML = `<span class="acc-val"></span><div class="acc-bar"><i></i></div><span class="acc-pos">#${i + 1}</span>`;
      return col;
    }));
  }
  by.forEach((v, i) => {
    const col = bars.children[i];
    col.querySelector(".acc-val").textContent = `${Math.round(v * 100)}%`;
    col.querySelector(".acc-bar > i").style.height = `${Math.max(0, Math.min(1, v)) * 100}%`;
  });
}

function renderGpus(s) {
  const gpus = s.gpu || [];
  const box = $("gpus");
  if (!gpus.length) {
    if (!box.querySelector(".none")) box.innerHTML = `<p class="none muted">No GPU: the model runs on the CPU.</p>`;
    return;
  }
  if (box.children.length !== gpus.length || box.querySelector(".none")) {
    box.replaceChildren(...gpus.map(() => {
      const el = document.createElement("div");
      el.className = "gpu";
      el.innerHTML = `<div class="gpu-name"></div>
        <div class="meter"><div class="meter-label"><span>Memory</span><span class="meter-value"></span></div><div class="bar"><i></i></div></div>
        <div class="gpu-stats muted"><span class="util"></span><span class="temp"></span></div>`;
      return el;
    }));
  }
  gpus.forEach((g, i) => {
    const el = box.children[i];
    el.querySelector(".gpu-name").textContent = `${g.index}: ${g.name}`;
    const frac = g.memory_total_bytes ? g.memory_used_bytes / g.memory_total_bytes : 0;
    el.querySelector(".meter-value").textContent = `${bytes(g.memory_used_bytes)} / ${bytes(g.memory_total_bytes)}`;
    el.querySelector(".bar > i").style.width = `${(Math.min(1, frac) * 100).toFixed(1)}%`;
    el.querySelector(".util").textContent = g.utilization_pct == null ? "utilisation –" : `utilisation ${Math.round(g.utilization_pct)}%`;
    el.querySelector(".temp").textContent = g.temperature_c == null ? "" : `${Math.round(g.temperature_c)} °C`;
  });
}

function renderRecent(s) {
  const rows = [...(s.recent || [])].sort((a, b) => b.ended_at - a.ended_at).slice(0, 25);
  const body = $("recent");
  if (!rows.length) {
    body.innerHTML = `<tr><td colspan="8" class="muted empty-row">No finished requests yet.</td></tr>`;
    return;
  }
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    const cells = [
      [ago(r.ended_at)], [r.id.length > 14 ? `…${r.id.slice(-8)}` : r.id, r.id], [int(r.prompt_tokens), null, "n"],
      [int(r.cached_tokens), null, "n"], [int(r.output_tokens), null, "n"], [ms(r.ttft_ms), null, "n"],
      [rate(r.decode_tps), null, "n"], [r.finish_reason, null, `finish ${r.finish_reason}`],
    ];
    for (const [text, title, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (title) td.title = title;
      if (cls) td.className = cls;
      tr.append(td);
    }
    return tr;
  }));
}

// ---- loop ---------------------------------------------------------------------------------

function showProblem(problem) {
  const banner = $("banner");
  banner.classList.toggle("hidden", !problem);
  if (!problem) return;
  banner.innerHTML = "<strong></strong> <span></span>";
  banner.querySelector("strong").textContent = problem.title;
  banner.querySelector("span").textContent = problem.detail;
}

function render(s) {
  setText("model", s.model);
  $("health").className = `dot ${s.healthy ? "ok" : "bad"}`;
  setText("uptime", `up ${duration(s.uptime_s)}`);
  renderThroughput(s);
  renderRequests(s);
  renderMemory(s);
  renderSpeculative(s);
  renderGpus(s);
  renderRecent(s);
  showProblem(s.healthy ? null : { title: "The engine has stopped", detail: "The server needs a restart." });
}

async function poll() {
  const started = performance.now();
  try {
    render(await getJSON("/stats"));
    lastOk = Date.now();
    setText("updated", "live");
    $("updated").classList.remove("stale");
  } catch (err) {
    $("health").className = "dot bad";
    const problem = err.status === 404
      ? { title: "This server has no /stats endpoint", detail: "Upgrade ninfer to see the monitor." }
      : describeError(err);
    showProblem(problem);
    setText("updated", lastOk ? `last update ${Math.round((Date.now() - lastOk) / 1000)} s ago` : "no data");
    $("updated").classList.add("stale");
  }
  setTimeout(poll, Math.max(100, INTERVAL_MS - (performance.now() - started)));
}

takeKeyFromUrl();
poll();
