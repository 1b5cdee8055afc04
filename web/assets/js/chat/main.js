// The chat page: conversations, streamed answers, stop / regenerate / edit, settings, import/export.

import { apiKey, describeError, getJSON, setApiKey, streamChat, takeKeyFromUrl } from "../api.js";
import { icon } from "../icons.js";
import { copyText, splitThinking } from "./markdown.js";
import { applyChunk, requestBody } from "./reply.js";
import { fillForm, readForm, summary } from "./settings.js";
import { renderList } from "./sidebar.js";
import * as store from "./store.js";
import { atBottom, emptyState, messageElement, systemNote, updateAssistant } from "./view.js";

const $ = (id) => document.getElementById(id);
const ui = {
  app: $("app"), list: $("conv-list"), messages: $("messages"), input: $("input"), send: $("send"),
  stop: $("stop"), title: $("conv-title"), model: $("model"), banner: $("banner"), hints: $("hints"),
  settings: $("settings"), settingsForm: $("settings-form"), importFile: $("import-file"), toast: $("toast"),
  attach: $("attach"), attachFile: $("attach-file"), attachments: $("attachments"),
};

const state = {
  settings: store.loadSettings(),
  conversations: [],
  current: null,       // the conversation on screen (saved once it has a message)
  model: null,         // {id, context}
  running: null,       // {conv, msg, controller, el}
  images: [],          // images attached to the message being written (data URIs)
};

// ---- model --------------------------------------------------------------------------------

async function loadModel() {
  clearTimeout(loadModel.retry);
  try {
    const models = await getJSON("/v1/models");
    const m = models.data[0];
    state.model = { id: m.id, context: m.meta?.context_length ?? null };
    ui.model.querySelector(".dot").className = "dot ok";
    ui.model.querySelector(".name").textContent = m.id;
    ui.model.title = state.model.context ? `context: ${state.model.context} tokens` : "";
    showBanner(null);
    if (!state.current.messages.length) renderMessages();
  } catch (err) {
    ui.model.querySelector(".dot").className = "dot bad";
    ui.model.querySelector(".name").textContent = "offline";
    showBanner(describeError(err));
    loadModel.retry = setTimeout(loadModel, err.status === 401 ? 15000 : 4000);
  }
}

function showBanner(problem) {
  ui.banner.classList.toggle("hidden", !problem);
  if (!problem) return;
  ui.banner.innerHTML = "<strong></strong> <span></span>";
  ui.banner.querySelector("strong").textContent = problem.title;
  ui.banner.querySelector("span").textContent = problem.detail;
}

function toast(text) {
  ui.toast.textContent = text;
  ui.toast.classList.remove("hidden");
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => ui.toast.classList.add("hidden"), 2500);
}

// ---- conversations ------------------------------------------------------------------------

function refreshList() {
  state.conversations = store.listConversations();
  renderList(ui.list, state.conversations, state.current?.id, state.running?.conv.id, {
    select: (id) => { selectConversation(id); closeDrawer(); },
    rename: (id, title) => {
      if (title !== null) {
        // the stored copy, and the live objects that would otherwise save the old name back
        for (const conv of new Set([state.conversations.find((c) => c.id === id), state.current, state.running?.conv])) {
          if (conv?.id !== id) continue;
          conv.title = title;
          store.saveConversation(conv);
        }
      }
      refreshList();
      renderTitle();
    },
    exportOne: (id) => store.download([state.conversations.find((c) => c.id === id)]),
    remove: (id) => {
      if (state.running?.conv.id === id) {
        state.running.conv.deleted = true;
        state.running.controller.abort();
      }
      store.deleteConversation(id);
      if (state.current?.id === id) state.current = store.newConversation();
      refreshList();
      renderMessages();
    },
  });
}

function selectConversation(id) {
  if (id === state.current?.id) return;
  state.current = state.running?.conv.id === id ? state.running.conv
    : state.conversations.find((c) => c.id === id) || store.newConversation();
  refreshList();
  renderMessages();
}

function newChat() {
  state.current = store.newConversation();
  refreshList();
  renderMessages();
  closeDrawer();
  ui.input.focus();
}

function persist(conv) {
  if (conv.deleted) return;
  conv.updated = Date.now();
  if (!store.saveConversation(conv)) toast("Browser storage is full: export and delete old conversations");
}

function renderTitle() {
  ui.title.textContent = store.titleOf(state.current);
  document.title = state.current.messages.length ? `${store.titleOf(state.current)} · NInfer` : "NInfer";
}

function renderMessages() {
  const conv = state.current;
  renderTitle();
  ui.messages.replaceChildren();
  if (!conv.messages.length) {
    ui.messages.append(emptyState(state.model?.id));
    return;
  }
  if (conv.system) ui.messages.append(systemNote(conv.system));
  for (const msg of conv.messages) {
    const el = messageElement(msg);
    if (state.running?.msg === msg) {
      state.running.el = el;
      updateAssistant(el, msg, true);
    }
    ui.messages.append(el);
  }
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

// ---- generation ---------------------------------------------------------------------------

async function generate(conv) {
  if (!state.model) await loadModel();
  conv.system = state.settings.system || conv.system || "";
  const msg = { id: store.newId(), role: "assistant", content: "", created: Date.now(), model: state.model?.id };
  const body = state.model ? requestBody(conv, state.settings, state.model.id) : null;
  conv.messages.push(msg);
  persist(conv);
  const run = { conv, msg, controller: new AbortController(), el: null };
  state.running = run;
  setBusy(true);
  refreshList();
  if (conv === state.current) renderMessages();

  const started = performance.now();
  let lastSave = Date.now();
  let frame = 0;
  const draw = () => {
    frame = 0;
    if (!run.el?.isConnected) return;
    const stick = atBottom(ui.messages);
    updateAssistant(run.el, msg, true);
    if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
  };
  try {
    if (!body) throw new TypeError("the model list could not be loaded");
    for await (const chunk of streamChat(body, run.controller.signal)) {
      applyChunk(msg, chunk, performance.now() - started);
      if (!frame) frame = requestAnimationFrame(draw);
      if (Date.now() - lastSave > 1000) {
        persist(conv);
        lastSave = Date.now();
      }
    }
  } catch (err) {
    if (err.name === "AbortError") msg.stopped = true;
    else msg.error = describeError(err);
  } finally {
    cancelAnimationFrame(frame);
    state.running = null;
    persist(conv);
    setBusy(false);
    refreshList();
    if (run.el?.isConnected) updateAssistant(run.el, msg, false);
  }
}

function setBusy(busy) {
  ui.send.classList.toggle("hidden", busy);
  ui.stop.classList.toggle("hidden", !busy);
  ui.app.classList.toggle("busy", busy);
}

function send() {
  const text = ui.input.value.trim();
  if ((!text && !state.images.length) || state.running) return;
  ui.input.value = "";
  autosize();
  const conv = state.current;
  const msg = { id: store.newId(), role: "user", content: text, created: Date.now() };
  if (state.images.length) msg.images = state.images;
  state.images = [];
  renderAttachments();
  conv.messages.push(msg);
  generate(conv);
}

// ---- attached images ----------------------------------------------------------------------

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    try {
      state.images.push(await readAsDataUrl(file));
    } catch {
      toast(`Could not read ${file.name || "the image"}`);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  ui.attachments.replaceChildren();
  ui.attachments.classList.toggle("hidden", !state.images.length);
  state.images.forEach((url, i) => {
    const item = document.createElement("span");
    item.className = "attachment";
    item.innerHTML = `<img alt="attached image" data-testid="attachment"><button type="button" class="icon"
      title="Remove" aria-label="Remove the image">${icon("x")}</button>`;
    item.querySelector("img").src = url;
    item.querySelector("button").addEventListener("click", () => {
      state.images.splice(i, 1);
      renderAttachments();
    });
    ui.attachments.append(item);
  });
}

function regenerate(msgId) {
  const conv = state.current;
  const i = conv.messages.findIndex((m) => m.id === msgId);
  if (state.running || i < 0) return;
  conv.messages.splice(i);
  generate(conv);
}

function startEdit(el, msgId) {
  const conv = state.current;
  const msg = conv.messages.find((m) => m.id === msgId);
  if (!msg || state.running) return;
  const bubble = el.querySelector(".bubble");
  const editor = document.createElement("div");
  editor.className = "editor";
  editor.innerHTML = `<textarea data-testid="edit-input" rows="3"></textarea>
    <div class="editor-buttons"><button type="button" data-e="cancel">Cancel</button>
    <button type="button" class="primary" data-e="send" data-testid="edit-send">Send</button></div>`;
  const area = editor.querySelector("textarea");
  area.value = msg.content;
  bubble.replaceWith(editor);
  el.classList.add("editing");
  area.focus();
  editor.querySelector('[data-e="cancel"]').addEventListener("click", () => renderMessages());
  editor.querySelector('[data-e="send"]').addEventListener("click", () => {
    const text = area.value.trim();
    if (!text || state.running) return;
    conv.messages.splice(conv.messages.indexOf(msg));
    conv.messages.push({ ...msg, content: text, created: Date.now() });
    generate(conv);
  });
}

// ---- import / export, settings ------------------------------------------------------------

async function importFile(file) {
  try {
    const imported = await store.importFile(file);
    state.current = imported[0];
    refreshList();
    renderMessages();
    toast(`Imported ${imported.length} conversation${imported.length > 1 ? "s" : ""}`);
  } catch (err) {
    showBanner({ title: `Could not import ${file.name}`, detail: err.message });
  }
}

function openSettings() {
  fillForm(ui.settingsForm, state.settings, apiKey());
  ui.settings.showModal();
}

function saveSettingsFromForm() {
  const { settings, key } = readForm(ui.settingsForm);
  state.settings = settings;
  store.saveSettings(settings);
  const keyChanged = key !== apiKey();
  setApiKey(key);
  renderHints();
  if (keyChanged || !state.model) loadModel();
}

function renderHints() {
  ui.hints.textContent = summary(state.settings);
}

// ---- wiring -------------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 200)}px`;
}

function closeDrawer() {
  ui.app.classList.remove("drawer-open");
}

function wire() {
  $("new-chat").innerHTML = `${icon("plus")}<span>New chat</span>`;
  $("import").innerHTML = `${icon("upload")}<span>Import</span>`;
  $("export-all").innerHTML = `${icon("download")}<span>Export all</span>`;
  $("open-settings").innerHTML = `${icon("settings")}<span>Settings</span>`;
  $("monitor-link").innerHTML = `${icon("chart")}<span>Monitor</span>`;
  $("menu").innerHTML = icon("menu");
  $("export-one").innerHTML = icon("download");
  ui.send.innerHTML = icon("send");
  ui.attach.innerHTML = icon("image");
  ui.attach.addEventListener("click", () => ui.attachFile.click());
  ui.attachFile.addEventListener("change", async () => {
    await attachFiles([...ui.attachFile.files]);
    ui.attachFile.value = "";
  });
  ui.input.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
    if (!files.length) return;
    e.preventDefault();
    attachFiles(files);
  });
  ui.stop.innerHTML = `${icon("stop")}<span>Stop</span>`;

  $("new-chat").addEventListener("click", newChat);
  $("menu").addEventListener("click", () => ui.app.classList.toggle("drawer-open"));
  $("scrim").addEventListener("click", closeDrawer);
  $("import").addEventListener("click", () => ui.importFile.click());
  ui.importFile.addEventListener("change", () => {
    for (const file of ui.importFile.files) importFile(file);
    ui.importFile.value = "";
  });
  $("export-all").addEventListener("click", () => {
    const all = store.listConversations();
    if (all.length) store.download(all);
    else toast("Nothing to export yet");
  });
  $("export-one").addEventListener("click", () => {
    if (state.current.messages.length) store.download([state.current]);
    else toast("Nothing to export yet");
  });
  $("open-settings").addEventListener("click", openSettings);
  ui.hints.addEventListener("click", openSettings);
  $("settings-cancel").addEventListener("click", () => ui.settings.close());
  ui.settingsForm.addEventListener("submit", (e) => {
    e.preventDefault();
    saveSettingsFromForm();
    ui.settings.close();
  });

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  ui.stop.addEventListener("click", () => state.running?.controller.abort());
  ui.input.addEventListener("input", autosize);
  const touch = matchMedia("(pointer: coarse)").matches;
  if (touch || matchMedia("(max-width: 760px)").matches) ui.input.placeholder = "Message the model";
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !touch && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });

  ui.messages.addEventListener("click", async (e) => {
    const suggestion = e.target.closest(".suggestion");
    if (suggestion) {
      ui.input.value = suggestion.textContent;
      autosize();
      ui.input.focus();
      return;
    }
    const copyCode = e.target.closest(".copy-code");
    if (copyCode) {
      const ok = await copyText(copyCode.closest(".code-block").querySelector("code").textContent);
      copyCode.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(() => { copyCode.textContent = "Copy"; }, 1500);
      return;
    }
    const button = e.target.closest("[data-action]");
    if (!button) return;
    const el = button.closest(".msg");
    const msg = state.current.messages.find((m) => m.id === el.dataset.id);
    if (!msg) return;
    if (button.dataset.action === "copy") {
      const text = msg.role === "assistant" ? splitThinking(msg.content).answer.trim() : msg.content;
      toast((await copyText(text)) ? "Copied" : "Copy failed");
    } else if (button.dataset.action === "regenerate") {
      regenerate(msg.id);
    } else if (button.dataset.action === "edit") {
      startEdit(el, msg.id);
    }
  });

  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.running && !ui.settings.open) state.running.controller.abort();
  });

  // another tab changed the stored conversations: show the new list
  window.addEventListener("storage", (e) => {
    if (e.key?.startsWith("ninfer.")) refreshList();
  });
}

takeKeyFromUrl();
wire();
state.current = store.listConversations()[0] || store.newConversation();
refreshList();
renderMessages();
renderHints();
loadModel();
