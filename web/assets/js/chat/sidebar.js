// The conversation list: select, rename in place, export, delete (click twice to confirm).

import { icon } from "../icons.js";
import { titleOf } from "./store.js";

/**
 * Draw ``conversations`` into ``list``. ``actions``: select(id), rename(id, title), exportOne(id),
 * remove(id). ``busyId`` marks the conversation whose answer is being generated.
 */
export function renderList(list, conversations, currentId, busyId, actions) {
  list.replaceChildren();
  if (!conversations.length) {
    const li = document.createElement("li");
    li.className = "conv-empty muted";
    li.textContent = "No conversations yet";
    list.append(li);
    return;
  }
  for (const conv of conversations) {
    const li = document.createElement("li");
    li.className = "conv";
    li.dataset.id = conv.id;
    li.dataset.testid = "conversation";
    li.classList.toggle("active", conv.id === currentId);
    li.classList.toggle("busy", conv.id === busyId);
    li.innerHTML = `<button type="button" class="conv-open" data-testid="conversation-open">
        <span class="conv-name"></span><span class="conv-date muted"></span></button>
      <span class="conv-tools">
        <button type="button" class="icon" data-act="rename" title="Rename" data-testid="rename">${icon("rename")}</button>
        <button type="button" class="icon" data-act="export" title="Export as JSON" data-testid="export">${icon("download")}</button>
        <button type="button" class="icon danger" data-act="delete" title="Delete" data-testid="delete">${icon("trash")}</button>
      </span>`;
    li.querySelector(".conv-name").textContent = titleOf(conv);
    li.querySelector(".conv-date").textContent = relativeDay(conv.updated);
    li.querySelector(".conv-open").addEventListener("click", () => actions.select(conv.id));
    li.querySelector('[data-act="rename"]').addEventListener("click", () => startRename(li, conv, actions));
    li.querySelector('[data-act="export"]').addEventListener("click", () => actions.exportOne(conv.id));
    const del = li.querySelector('[data-act="delete"]');
    del.addEventListener("click", () => {
      if (del.classList.contains("confirm")) {
        actions.remove(conv.id);
        return;
      }
      del.classList.add("confirm");
      del.innerHTML = `${icon("trash")}<span>Delete?</span>`;
      setTimeout(() => {
        if (!del.isConnected) return;
        del.classList.remove("confirm");
        del.innerHTML = icon("trash");
      }, 4000);
    });
    list.append(li);
  }
}

function startRename(li, conv, actions) {
  const open = li.querySelector(".conv-open");
  const input = document.createElement("input");
  input.type = "text";
  input.className = "conv-rename";
  input.value = titleOf(conv);
  input.dataset.testid = "rename-input";
  input.setAttribute("aria-label", "Conversation name");
  open.replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (save) => {
    if (done) return;
    done = true;
    actions.rename(conv.id, save ? input.value.trim() : null);
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    else if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

function relativeDay(ms) {
  const d = new Date(ms);
  const now = new Date();
  if (d.toDateString() === now.toDateString()) {
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  }
  return d.toLocaleDateString([], { month: "short", day: "numeric" });
}
