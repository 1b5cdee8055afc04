// Drawing a conversation: message elements, the streamed reply, reasoning, timing lines.

import { icon } from "../icons.js";
import { escapeHtml, renderMarkdown, splitThinking } from "./markdown.js";

const SUGGESTIONS = [
  "Explain what a hash table is, with a short Python example.",
  "Give me three tips for writing clear emails.",
  "What is the difference between a list and a tuple in Python?",
];

export function formatMs(ms) {
  if (ms == null || !Number.isFinite(ms)) return "–";
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
}

function formatRate(tps) {
  return tps == null || !Number.isFinite(tps) ? "–" : tps >= 100 ? tps.toFixed(0) : tps.toFixed(1);
}

/** The line under an answer: tokens, tok/s and time to first token from the server's timings. */
export function timingLine(msg) {
  const t = msg.timings;
  const parts = [];
  if (t) {
    parts.push(`${t.predicted_n} tokens`, `${formatRate(t.predicted_per_second)} tok/s`, `TTFT ${formatMs(t.prompt_ms)}`);
  } else if (msg.chunks) {
    parts.push(`${msg.chunks} tokens`);
  }
  if (msg.stopped) parts.push("stopped");
  else if (msg.finish_reason === "length") parts.push("cut at the token limit");
  else if (msg.chunks && !msg.finish_reason && !msg.error) parts.push("interrupted");  // page closed mid-answer
  return parts.join(" · ");
}

function timingTitle(msg) {
  const t = msg.timings;
  if (!t) return "";
  const lines = [
    `prompt: ${t.prompt_n} new tokens in ${formatMs(t.prompt_ms)} (${formatRate(t.prompt_per_second)} tok/s)`,
    `answer: ${t.predicted_n} tokens in ${formatMs(t.predicted_ms)} (${formatRate(t.predicted_per_second)} tok/s)`,
  ];
  const cached = msg.usage?.prompt_tokens_details?.cached_tokens;
  if (cached) lines.push(`prompt cache: ${cached} tokens reused`);
  if (msg.ttft_ms != null) lines.push(`first token in this browser after ${formatMs(msg.ttft_ms)}`);
  return lines.join("\n");
}

export function emptyState(model) {
  const el = document.createElement("div");
  el.className = "empty";
  el.dataset.testid = "empty";
  el.innerHTML = `<div class="empty-icon">${icon("chat")}</div>
    <h2>Chat with ${escapeHtml(model || "the model")}</h2>
    <p class="muted">Conversations stay in this browser; export them as JSON from the conversation list.</p>
    <div class="suggestions">${SUGGESTIONS.map((s) => `<button type="button" class="suggestion">${escapeHtml(s)}</button>`).join("")}</div>`;
  return el;
}

export function systemNote(text) {
  const el = document.createElement("details");
  el.className = "system-note";
  el.innerHTML = `<summary>System prompt</summary><div class="system-text"></div>`;
  el.querySelector(".system-text").textContent = text;
  return el;
}

export function messageElement(msg) {
  const el = document.createElement("article");
  el.className = `msg ${msg.role}`;
  el.dataset.id = msg.id;
  el.dataset.testid = `message-${msg.role}`;
  if (msg.role === "user") {
    el.innerHTML = `<div class="bubble"></div>
      <div class="msg-actions">
        <button type="button" class="icon" data-action="edit" title="Edit and resend" data-testid="edit">${icon("edit")}</button>
        <button type="button" class="icon" data-action="copy" title="Copy">${icon("copy")}</button>
      </div>`;
    el.querySelector(".bubble").textContent = msg.content;
    if (msg.images?.length) {
      const strip = document.createElement("div");
      strip.className = "msg-images";
      for (const url of msg.images) {
        const img = document.createElement("img");
        img.src = url;
        img.alt = "attached image";
        img.dataset.testid = "message-image";
        strip.append(img);
      }
      el.prepend(strip);
    }
    return el;
  }
  el.innerHTML = `<details class="reasoning hidden" data-testid="reasoning"><summary></summary><div class="md"></div></details>
    <div class="md answer" data-testid="answer"></div>
    <div class="msg-error hidden" data-testid="message-error"></div>
    <footer class="msg-foot">
      <span class="timing" data-testid="timing"></span>
      <span class="msg-actions">
        <button type="button" class="icon" data-action="copy" title="Copy answer">${icon("copy")}</button>
        <button type="button" class="icon" data-action="regenerate" title="Regenerate" data-testid="regenerate">${icon("refresh")}</button>
      </span>
    </footer>`;
  el.querySelector(".reasoning").addEventListener("toggle", (e) => {
    if (e.isTrusted) el.dataset.userToggled = "1";
  });
  updateAssistant(el, msg, false);
  return el;
}

/** Redraw an assistant message; ``streaming`` while its reply is still arriving. */
export function updateAssistant(el, msg, streaming) {
  const split = splitThinking(msg.content || "");
  const reasoning = (msg.reasoning || "") + split.reasoning;
  const thinking = streaming && !split.answer.trim() && (split.open || (msg.reasoning && !msg.content));
  el.classList.toggle("streaming", streaming);

  const details = el.querySelector(".reasoning");
  details.classList.toggle("hidden", !reasoning.trim());
  if (reasoning.trim()) {
    details.querySelector("summary").textContent = thinking ? "Thinking…"
      : `Reasoning · ${reasoning.trim().split(/\s+/).length} words`;
    details.querySelector(".md").innerHTML = renderMarkdown(reasoning);
    if (!el.dataset.userToggled) details.open = thinking;
  }

  const answer = el.querySelector(".answer");
  const waiting = streaming && !split.answer && !reasoning;
  answer.innerHTML = waiting ? `<span class="typing" data-testid="waiting"><i></i><i></i><i></i></span>`
    : renderMarkdown(split.answer) + (streaming ? `<span class="cursor"></span>` : "");

  const error = el.querySelector(".msg-error");
  error.classList.toggle("hidden", !msg.error);
  if (msg.error) {
    error.innerHTML = `<strong></strong> <span></span>`;
    error.querySelector("strong").textContent = msg.error.title;
    error.querySelector("span").textContent = msg.error.detail;
  }

  const timing = el.querySelector(".timing");
  timing.textContent = streaming ? "" : timingLine(msg);
  timing.title = streaming ? "" : timingTitle(msg);
  el.querySelector(".msg-foot").classList.toggle("hidden", streaming);
}

/** True when the view is scrolled (nearly) to the bottom, so new text should keep it there. */
export function atBottom(container) {
  return container.scrollHeight - container.scrollTop - container.clientHeight < 80;
}
