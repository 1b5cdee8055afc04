// Markdown to HTML for model output: highlighted code blocks with a copy button; raw HTML is shown
// as text, and nothing is fetched (images become links), so a reply cannot run script or phone out.

import { Marked } from "../../../vendor/marked/marked.esm.js";
import hljs from "../../../vendor/highlight/highlight.min.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function safeHref(href) {
  try {
    const url = new URL(href, location.href);
    return ["http:", "https:", "mailto:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function highlight(code, lang) {
  if (lang && hljs.getLanguage(lang)) {
    try {
      return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    } catch { /* fall through to plain text */ }
  }
  return escapeHtml(code);
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
    code({ text, lang }) {
      const language = (lang || "").trim().split(/\s+/)[0].toLowerCase();
      return `<div class="code-block"><div class="code-head"><span>${escapeHtml(language || "text")}</span>`
        + `<button type="button" class="icon copy-code" title="Copy code">Copy</button></div>`
        + `<pre><code class="hljs">${highlight(text.replace(/\n$/, ""), language)}</code></pre></div>`;
    },
    link({ href, title, tokens }) {
      const inner = this.parser.parseInline(tokens);
      const url = safeHref(href);
      if (!url) return inner;
      const t = title ? ` title="${escapeHtml(title)}"` : "";
      return `<a href="${escapeHtml(url)}"${t} target="_blank" rel="noopener noreferrer nofollow">${inner}</a>`;
    },
    image({ href, text }) {
      const url = safeHref(href);
      const label = escapeHtml(text || "image");
      return url ? `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer nofollow">[image: ${label}]</a>`
        : `[image: ${label}]`;
    },
  },
});

export function renderMarkdown(source) {
  return marked.parse(source || "");
}

/**
 * Split a reply into reasoning and answer: text inside <think>...</think>, or before a lone
 * </think> (templates that open the block in the prompt). ``open`` is true while the reasoning
 * has not been closed yet.
 */
export function splitThinking(content) {
  const start = content.indexOf("<think>");
  const end = content.indexOf("</think>");
  if (start >= 0 && (end < 0 || start < end)) {
    const before = content.slice(0, start);
    if (end < 0) return { reasoning: content.slice(start + 7), answer: before, open: true };
    return { reasoning: content.slice(start + 7, end), answer: before + content.slice(end + 8), open: false };
  }
  if (end >= 0) return { reasoning: content.slice(0, end), answer: content.slice(end + 8), open: false };
  return { reasoning: "", answer: content, open: false };
}

/** Copy text, also on plain-http LAN pages where navigator.clipboard does not exist. */
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch { /* fall back below */ }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.className = "offscreen";
  document.body.append(area);
  area.select();
  let ok = false;
  try {
    ok = document.execCommand("copy");
  } catch { /* ok stays false */ }
  area.remove();
  return ok;
}
