// Foveal's built-in page: a chat (streamed chat completions: text, folded thinking, tool calls, images)
// and a live dashboard (GET /v1/metrics, once a second). It talks to the server's own API like any client,
// with the API key typed in the header (kept in this browser's localStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], images: [], controller: null, tps: [], last: null };

const keyInput = $("api-key");
keyInput.value = localStorage.getItem("foveal-api-key") || "";
keyInput.addEventListener("change", () => {
  localStorage.setItem("foveal-api-key", keyInput.value);
  loadModels();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}

async function api(path, init = {}) {
  const r = await fetch(path, { ...init, headers: headers() });
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try { msg = (await r.json()).error.message || msg; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return r;
}

// -- tabs -------------------------------------------------------------------------------------------------
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== tab.dataset.view;
    if (tab.dataset.view === "dashboard") pollMetrics();
  });
}

// -- models -----------------------------------------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  try {
    const models = (await (await api("/v1/models")).json()).data;
    select.innerHTML = "";
    for (const m of models) {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
      select.appendChild(o);
    }
    setStatus("");
  } catch (e) {
    setStatus("models: " + e.message);
  }
}

function setStatus(text) { $("status").textContent = text; }

// -- chat -------------------------------------------------------------------------------------------------
function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  $("messages").appendChild(div);
  return div;
}

function scroll() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

$("image").addEventListener("change", (ev) => {
  for (const file of ev.target.files) {
    const reader = new FileReader();
    reader.onload = () => {
      state.images.push(reader.result);
      const img = document.createElement("img");
      img.src = reader.result;
      $("attachments").appendChild(img);
    };
    reader.readAsDataURL(file);
  }
  ev.target.value = "";
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});

$("clear").addEventListener("click", () => { state.history = []; $("messages").innerHTML = ""; });
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });

$("composer").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text && !state.images.length) return;
  const content = state.images.length
    ? [{ type: "text", text }, ...state.images.map((url) => ({ type: "image_url", image_url: { url } }))]
    : text;
  const user = bubble("user");
  user.textContent = text;
  for (const url of state.images) { const img = document.createElement("img"); img.src = url; user.appendChild(img); }
  state.history.push({ role: "user", content });
  state.images = [];
  $("attachments").innerHTML = "";
  $("prompt").value = "";
  await reply();
});

async function reply() {
  const out = bubble("assistant");
  const thinking = document.createElement("details");
  thinking.innerHTML = "<summary>Thinking</summary>";
  const thought = document.createElement("div");
  thinking.appendChild(thought);
  const body = document.createElement("div");
  body.className = "text";
  const meta = document.createElement("div");
  meta.className = "meta";
  out.append(thinking, body, meta);
  thinking.hidden = true;
  const calls = [];
  let text = "", reasoning = "", finish = null, usage = null;
  const messages = $("system").value.trim()
    ? [{ role: "system", content: $("system").value.trim() }, ...state.history]
    : state.history;
  const request = {
    model: $("model").value || undefined, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setStatus("generating...");
  const t0 = performance.now();
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(request), signal: state.controller.signal,
    });
    if (!r.ok) {
      const raw = await r.text();
      let msg = `${r.status} ${raw.slice(0, 300)}`;
      try { msg = JSON.parse(raw).error.message; } catch (e) { /* not our JSON error: shown as sent */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        if (!frame.startsWith("data: ")) continue;
        const data = frame.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          const d = c.delta || {};
          if (d.reasoning_content) { reasoning += d.reasoning_content; thought.textContent = reasoning; thinking.hidden = false; }
          if (d.content) { text += d.content; body.textContent = text; }
          for (const tc of d.tool_calls || []) {
            if (!calls[tc.index]) {
              const el = document.createElement("div");
              el.className = "call";
              out.insertBefore(el, meta);
              calls[tc.index] = { id: tc.id, name: tc.function.name, arguments: "", el };
            }
            const call = calls[tc.index];
            call.arguments += tc.function.arguments || "";
            call.el.textContent = `${call.name}(${call.arguments})`;
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
        scroll();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else {
      finish = "error";
      out.classList.add("error");
      body.textContent = (text ? text + "\n" : "") + "Error: " + e.message;
    }
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  const secs = (performance.now() - t0) / 1000;
  const toks = usage ? usage.completion_tokens : null;
  meta.textContent = [finish && `finish: ${finish}`, toks != null && `${toks} tokens in ${secs.toFixed(2)} s`]
    .filter(Boolean).join(" · ");
  setStatus("");
  const msg = { role: "assistant", content: text || null };
  if (reasoning) msg.reasoning_content = reasoning;
  if (calls.length) {
    msg.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
  }
  if (text || calls.length) state.history.push(msg);
}

// -- dashboard --------------------------------------------------------------------------------------------
let polling = null;

async function pollMetrics() {
  if (polling) return;
  const tick = async () => {
    if ($("dashboard").hidden) { polling = null; return; }
    try {
      const m = await (await api("/v1/metrics")).json();
      showMetrics(m);
      $("dash-error").textContent = "";
    } catch (e) {
      $("dash-error").textContent = "metrics: " + e.message;
    }
    polling = setTimeout(tick, 1000);
  };
  polling = setTimeout(tick, 0);
}

function fmt(v, digits = 1) { return v == null ? "-" : Number(v).toFixed(digits); }

function showMetrics(m) {
  const s = m.summary || {};
  const now = performance.now() / 1000;
  const tokens = s.completion_tokens || 0;
  if (state.last) {
    const rate = (tokens - state.last.tokens) / (now - state.last.t);
    state.tps.push(Math.max(0, rate));
    if (state.tps.length > 120) state.tps.shift();
  }
  state.last = { tokens, t: now };
  const recentTps = state.tps.slice(-5);
  $("m-tps").textContent = recentTps.length ? fmt(recentTps.reduce((a, b) => a + b, 0) / recentTps.length) : "-";
  $("m-running").textContent = s.num_running ?? "-";
  $("m-waiting").textContent = s.num_waiting ?? "-";
  $("m-kv").textContent = s.kv_cache_usage == null ? "-" : fmt(100 * s.kv_cache_usage) + " %";
  const q = s.prefix_cache_query_tokens;
  $("m-prefix").textContent = q ? fmt(100 * s.prefix_cache_hit_tokens / q) + " %" : "-";
  const spec = s.speculative;
  $("m-spec").textContent = spec && spec.num_draft_tokens
    ? fmt(100 * spec.num_accepted_tokens / spec.num_draft_tokens) + " %" : "-";
  $("m-requests").textContent = s.requests_completed == null ? "-" : `${s.requests_completed} / ${s.requests_failed}`;
  $("m-decode").textContent = fmt(s.avg_decode_tokens_per_s);
  const rows = (m.recent || []).slice().reverse().map((r) =>
    `<tr><td>${r.request_id}</td><td>${r.prompt_tokens}</td><td>${r.completion_tokens}</td>` +
    `<td>${r.ttft_s == null ? "-" : fmt(1000 * r.ttft_s, 0)}</td><td>${fmt(r.request_time_s, 2)}</td>` +
    `<td>${fmt(r.decode_tokens_per_s)}</td><td>${r.error ? "error" : r.finish_reason || "-"}</td></tr>`);
  $("recent").innerHTML = rows.join("");
  drawChart();
}

function drawChart() {
  const c = $("tps-chart");
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const max = Math.max(1, ...state.tps);
  g.strokeStyle = "#3b5bdb";
  g.lineWidth = 2;
  g.beginPath();
  state.tps.forEach((v, i) => {
    const x = (i / 119) * c.width, y = c.height - 8 - (v / max) * (c.height - 16);
    if (i === 0) g.moveTo(x, y); else g.lineTo(x, y);
  });
  g.stroke();
  g.fillStyle = "#6b6b72";
  g.fillText(`tokens/s (max ${fmt(max)})`, 8, 14);
}

loadModels();
