// Talking to the NInfer server: the API key, JSON calls, streamed chat completions, and error
// messages a person can act on. Shared by the chat page and the monitor.

const KEY_STORAGE = "ninfer.apiKey";
// The server root, from where this module is served (/assets/js/api.js), so that the pages also
// work behind a reverse proxy that mounts the server under a path.
const ROOT = new URL("../../", import.meta.url);

export function apiUrl(path) {
  return new URL(path.replace(/^\//, ""), ROOT).href;
}

/** Move a ?key=... from the address bar into storage, so that it is remembered and not shown. */
export function takeKeyFromUrl() {
  const url = new URL(location.href);
  if (!url.searchParams.has("key")) return;
  setApiKey(url.searchParams.get("key"));
  url.searchParams.delete("key");
  history.replaceState(history.state, "", url.pathname + url.search + url.hash);
}

export function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key.trim());
  else localStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.name = "ApiError";
    this.status = status;
    this.code = error?.code || null;
    this.param = error?.param || null;
  }
}

async function errorFrom(response) {
  let error = null;
  try {
    error = (await response.json()).error;
  } catch { /* not JSON: keep the status alone */ }
  return new ApiError(response.status, error || { message: response.statusText });
}

export async function getJSON(path, { signal } = {}) {
  const response = await fetch(apiUrl(path), { headers: headers(), cache: "no-store", signal });
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

/** POST a streamed chat completion and yield its chunks; an error inside the stream is thrown. */
export async function* streamChat(body, signal) {
  const response = await fetch(apiUrl("/v1/chat/completions"), {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorFrom(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r/g, "");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(chunk.error.code === "server_overloaded" ? 429 : 500, chunk.error);
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

/** What went wrong, said so that a person knows what to do next: {title, detail}. */
export function describeError(err) {
  if (err?.name === "AbortError") return { title: "Stopped", detail: "" };
  if (!(err instanceof ApiError)) {
    return {
      title: "Cannot reach the server",
      detail: `${new URL(apiUrl("/")).host} did not answer (${err?.message || err}). Is ninfer-serve running?`,
    };
  }
  const detail = err.message;
  if (err.status === 401) {
    return {
      title: "Unauthorised: this server needs an API key",
      detail: apiKey()
        ? "The saved key was refused. Open the link with ?key=… that you were given, or fix the key in Settings."
        : "Open the link with ?key=… that you were given, or enter the key in Settings.",
    };
  }
  if (err.status === 429 || err.code === "server_overloaded") {
    return { title: "The server is busy: its request queue is full", detail: "Try again in a moment." };
  }
  if (err.code === "context_length_exceeded") {
    return {
      title: "Too long for the model's context",
      detail: `${detail}. Start a new conversation, or edit or delete earlier messages.`,
    };
  }
  if (err.code === "request_queue_timeout") {
    return { title: "The request waited too long in the queue", detail: `${detail}. Try again.` };
  }
  if (err.code === "engine_failed" || err.status === 503) {
    return { title: "The engine has stopped", detail: `${detail}. The server needs a restart.` };
  }
  return { title: `The server refused the request (HTTP ${err.status})`, detail };
}
