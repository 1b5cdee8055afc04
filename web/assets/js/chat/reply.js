// One answer on the wire: the request body for a conversation, and stream chunks folded into a message.

import { splitThinking } from "./markdown.js";

/** The Chat Completions body for ``conv`` (its last message is the user's) with ``settings``. */
export function requestBody(conv, settings, model) {
  const messages = [];
  if (conv.system) messages.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m.role === "user") messages.push({ role: "user", content: userContent(m) });
    // earlier answers go back without their reasoning; failed ones not at all
    else if (m.content && !m.error) messages.push({ role: "assistant", content: splitThinking(m.content).answer.trim() });
  }
  const body = { model, messages, enable_thinking: !!settings.thinking };
  for (const key of ["temperature", "top_p", "max_tokens"]) if (settings[key] != null) body[key] = settings[key];
  return body;
}

/** A user message's content: its text, or with images text and ``image_url`` parts (data URIs). */
export function userContent(m) {
  if (!m.images?.length) return m.content;
  const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (m.content) parts.push({ type: "text", text: m.content });
  return parts;
}

/** Fold one streamed chunk into ``msg``; ``elapsedMs`` since the request was sent. */
export function applyChunk(msg, chunk, elapsedMs) {
  const choice = chunk.choices?.[0];
  const delta = choice?.delta || {};
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (delta.content || reasoning) {
    if (msg.ttft_ms == null) msg.ttft_ms = elapsedMs;
    msg.content += delta.content || "";
    if (reasoning) msg.reasoning = (msg.reasoning || "") + reasoning;
    msg.chunks = (msg.chunks || 0) + 1;
  }
  if (choice?.finish_reason) msg.finish_reason = choice.finish_reason;
  if (chunk.timings) msg.timings = chunk.timings;
  if (chunk.usage) msg.usage = chunk.usage;
}
