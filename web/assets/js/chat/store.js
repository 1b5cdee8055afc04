// Conversations and settings, kept in this browser's localStorage (one key per conversation), and
// their export / import as JSON.

const CONV_PREFIX = "ninfer.conv.";
const SETTINGS_KEY = "ninfer.settings";
export const FORMAT = "ninfer.conversations";

export const DEFAULT_SETTINGS = {
  system: "",
  temperature: null,   // null: the server's default
  top_p: null,
  max_tokens: null,
  thinking: false,
};

export function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: "", created: now, updated: now, system: "", messages: [] };
}

/** All conversations, most recently updated first. */
export function listConversations() {
  const out = [];
  for (let i = 0; i < localStorage.length; i++) {
    const key = localStorage.key(i);
    if (!key.startsWith(CONV_PREFIX)) continue;
    try {
      out.push(JSON.parse(localStorage.getItem(key)));
    } catch { /* a damaged entry is skipped, not fatal */ }
  }
  return out.sort((a, b) => b.updated - a.updated);
}

export function saveConversation(conv) {
  try {
    localStorage.setItem(CONV_PREFIX + conv.id, JSON.stringify(conv));
    return true;
  } catch {
    return false;  // storage full: the caller tells the user
  }
}

export function deleteConversation(id) {
  localStorage.removeItem(CONV_PREFIX + id);
}

export function titleOf(conv) {
  if (conv.title) return conv.title;
  const first = conv.messages.find((m) => m.role === "user");
  const text = (first?.content || "").replace(/\s+/g, " ").trim();
  return text ? (text.length > 60 ? `${text.slice(0, 57)}…` : text) : "New chat";
}

export function exportJSON(conversations) {
  return JSON.stringify({ format: FORMAT, version: 1, exported: new Date().toISOString(), conversations }, null, 2);
}

/** Save ``conversations`` as a JSON file through the browser's download. */
export function download(conversations) {
  const blob = new Blob([exportJSON(conversations)], { type: "application/json" });
  const name = conversations.length === 1
    ? titleOf(conversations[0]).toLowerCase().replace(/[^a-z0-9]+/g, "-").replace(/^-|-$/g, "").slice(0, 40)
    : "conversations";
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `ninfer-${name || "chat"}-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

/** Read an exported file and store its conversations (new ids where one exists); returns them. */
export async function importFile(file) {
  const imported = parseImport(await file.text());
  const existing = new Set(listConversations().map((c) => c.id));
  for (const conv of imported) {
    if (existing.has(conv.id)) conv.id = newId();
    saveConversation(conv);
  }
  return imported;
}

/**
 * Conversations from an exported file. Accepts this app's export (one or many), a bare
 * conversation, a list of them, and other chat exports with a ``messages`` list of
 * {role, content}; system messages become the conversation's system prompt.
 */
export function parseImport(text) {
  let data;
  try {
    data = JSON.parse(text);
  } catch {
    throw new Error("the file is not JSON");
  }
  const items = Array.isArray(data) ? data : Array.isArray(data?.conversations) ? data.conversations : [data];
  const out = items.map(normalise).filter(Boolean);
  if (!out.length) throw new Error("the file holds no conversation (no list of messages with role and content)");
  return out;
}

const ROLES = new Set(["user", "assistant", "system"]);

function text(value) {
  if (typeof value === "string") return value;
  if (Array.isArray(value)) return value.map((p) => (typeof p === "string" ? p : p?.text || "")).join("");
  return "";
}

/** The images (data URIs) of an exported message: this app's ``images``, or ``image_url`` parts. */
function imagesOf(m) {
  const urls = Array.isArray(m.images) ? m.images : [];
  const parts = Array.isArray(m.content) ? m.content.map((p) => p?.image_url?.url ?? p?.image_url) : [];
  return [...urls, ...parts].filter((u) => typeof u === "string" && u.startsWith("data:image/"));
}

function normalise(item) {
  const meta = item?.conv && typeof item.conv === "object" ? { ...item.conv, ...item } : item;
  if (!meta || !Array.isArray(meta.messages)) return null;
  const conv = newConversation();
  if (typeof meta.id === "string" && meta.id) conv.id = meta.id;
  conv.title = String(meta.title || meta.name || "");
  const created = Number(meta.created || meta.createdAt || meta.lastModified);
  const updated = Number(meta.updated || meta.lastModified || created);
  if (created > 0) conv.created = created;
  if (updated > 0) conv.updated = updated;
  conv.system = typeof meta.system === "string" ? meta.system : "";
  for (const m of meta.messages) {
    if (!m || !ROLES.has(m.role)) continue;
    const content = text(m.content);
    if (m.role === "system") {
      conv.system = conv.system ? `${conv.system}\n\n${content}` : content;
      continue;
    }
    const msg = { id: typeof m.id === "string" && m.id ? m.id : newId(), role: m.role, content,
                  created: Number(m.created || m.timestamp) || conv.created };
    const images = imagesOf(m);
    if (images.length && m.role === "user") msg.images = images;
    const reasoning = text(m.reasoning ?? m.reasoning_content ?? m.thinking);
    if (reasoning) msg.reasoning = reasoning;
    for (const key of ["timings", "usage", "finish_reason", "model", "stopped", "error", "ttft_ms"]) {
      if (m[key] !== undefined && m[key] !== null) msg[key] = m[key];
    }
    conv.messages.push(msg);
  }
  return conv.messages.length || conv.system ? conv : null;
}
