// The tokios web chat: conversations kept in the browser (conversations.js), replies streamed from
// /v1/chat/completions over SSE and rendered as safe markdown (markdown.js), the settings panel
// (settings.js), the model picker fed by /v1/models, and the API key asked for once when the
// server answers 401. Per reply it shows TTFT, tokens per second, tokens and the finish reason,
// or the error that ended it.
"use strict";

import { ConversationStore } from "./conversations.js";
import { copyButton, isMarkdownAvailable, renderMarkdown } from "./markdown.js";
import { bindSettings, loadSetting, requestOptions, resetSettings, saveSetting, showServerDefaults } from "./settings.js";

const $ = (id) => document.getElementById(id);
const KEY_NEEDED = "API key needed";
// A streaming reply's markdown is rendered again at most every 50 ms, and at most a fifth of the
// time: a long reply takes longer to render, and the page must not starve the reading of the stream.
const MIN_RENDER_INTERVAL_MS = 50;
const MAX_RENDER_SHARE = 0.2;
const THEMES = ["auto", "light", "dark"];

const store = new ConversationStore();

// Runs a change of the conversations; storage that is full is said in the page, and the page goes
// on with what it has in memory.
function saving(change) {
  try {
    return change();
  } catch (err) {
    showNotice(`Not saved: ${err.message}`);
    return undefined;
  }
}
// The reply being streamed, if any: which conversation and message it writes, and how to stop it.
let streaming = null;
let keyTimer = null; // debounces /v1/models while a key is being typed

// ---- server, key and models ----

function authHeaders() {
  const key = loadSetting("api-key").trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message || JSON.stringify(body.error) : JSON.stringify(body);
  } catch (_) {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}

function showKeyBanner(isShown) {
  $("key-banner").hidden = !isShown;
  if (isShown) $("key-banner-input").focus();
}

// The cards of /v1/models by model id, kept for the picker's choice: its sampling defaults fill
// the empty settings' placeholders.
let idToCard = new Map();

function showModelDefaults() {
  const card = idToCard.get($("model-picker").value);
  showServerDefaults(card ? card.sampling_defaults : undefined);
}

// Asks /health and /v1/models first and then fills the header in one go, so the badge and the
// model name never show two different moments (a "ready" badge beside a name still loading).
async function refreshServer() {
  let health;
  let models;
  try {
    health = await fetch("/health");
    models = await fetch("/v1/models", { headers: authHeaders() });
  } catch (err) {
    $("server-status").textContent = "offline";
    $("server-status").className = "badge bad";
    return;
  }
  let status = "ready";
  if (!health.ok) {
    try {
      status = (await health.json()).status || `HTTP ${health.status}`;
    } catch (_) {
      status = `HTTP ${health.status}`;
    }
  }
  let modelName;
  let cards = null;
  if (models.status === 401) {
    modelName = KEY_NEEDED;
  } else if (!models.ok) {
    modelName = await errorText(models);
  } else {
    cards = (await models.json()).data;
  }
  let chosen = "";
  if (cards) {
    const saved = loadSetting("model") || "";
    chosen = cards.some((card) => card.id === saved) ? saved : cards.length ? cards[0].id : "";
    idToCard = new Map(cards.map((card) => [card.id, card]));
    $("model-picker").replaceChildren(...cards.map((card) => {
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.state && card.state !== "loaded" ? `${card.id} (${card.state})` : card.id;
      return option;
    }));
    $("model-picker").value = chosen;
    showModelDefaults();
    modelName = chosen;
  }
  $("server-status").textContent = status;
  $("server-status").className = `badge ${health.ok ? "ok" : "bad"}`;
  $("model-name").textContent = modelName;
  $("model-name").classList.toggle("repeats-picker", cards !== null);
  showKeyBanner(models.status === 401);
}

// ---- rendering ----

function statsText(stats) {
  const parts = [];
  if (stats.ttft_s !== undefined) parts.push(`TTFT ${stats.ttft_s.toFixed(2)} s`);
  if (stats.tokens_per_s !== undefined) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  if (stats.num_tokens !== undefined) parts.push(`${stats.num_tokens} tokens`);
  if (stats.finish_reason) parts.push(stats.finish_reason);
  if (stats.model) parts.push(stats.model);
  return parts.join(" · ");
}

function actionButton(label, className, onClick) {
  const button = document.createElement("button");
  button.type = "button";
  button.className = `${className} needs-idle`;
  button.textContent = label;
  button.addEventListener("click", () => {
    if (!streaming) onClick();
  });
  return button;
}

// Fills an assistant or user bubble's content, error and footer from its message.
// A reasoning model's thinking: plain text in a fold above the answer, open while no answer
// has come (as it streams, or when the reply ended in its thinking); the reader opens it else.
function fillThinking(bubble, message) {
  const thinking = bubble.querySelector(".thinking");
  thinking.hidden = !message.reasoning;
  thinking.querySelector(".thinking-text").textContent = message.reasoning || "";
  if (!message.content) thinking.open = true;
}

function fillBubble(bubble, message, index) {
  fillThinking(bubble, message);
  const content = bubble.querySelector(".content");
  if (message.role === "assistant") renderMarkdown(content, message.content);
  else content.textContent = message.content;
  const error = bubble.querySelector(".error-text");
  error.hidden = !message.error;
  error.textContent = message.error ? `Error: ${message.error}` : "";
  bubble.querySelector(".stats").textContent = message.stats ? statsText(message.stats) : "";
  const actions = bubble.querySelector(".actions");
  if (message.role === "user") {
    actions.replaceChildren(actionButton("Edit", "edit", () => startEdit(bubble, index)),
                            copyButton(() => message.content));
  } else {
    actions.replaceChildren(copyButton(() => message.content),
                            actionButton("Regenerate", "regenerate", () => regenerate(index)));
  }
}

function makeBubble(message, index) {
  const bubble = document.createElement("article");
  bubble.className = `message ${message.role}`;
  bubble.dataset.index = String(index);
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thinkingText = document.createElement("div");
  thinkingText.className = "thinking-text";
  thinking.append(summary, thinkingText);
  const content = document.createElement("div");
  content.className = "content";
  const error = document.createElement("p");
  error.className = "error-text";
  const footer = document.createElement("footer");
  const stats = document.createElement("span");
  stats.className = "stats";
  const actions = document.createElement("span");
  actions.className = "actions";
  footer.append(stats, actions);
  bubble.append(thinking, content, error, footer);
  fillBubble(bubble, message, index);
  return bubble;
}

function isNearBottom() {
  const list = $("messages");
  return list.scrollHeight - list.scrollTop - list.clientHeight < 80;
}

function renderMessages() {
  const conversation = store.current();
  const messages = conversation ? conversation.messages : [];
  $("messages").replaceChildren(...messages.map(makeBubble));
  if (streaming && conversation && streaming.conversationId === conversation.id) {
    const bubble = $("messages").children[streaming.index];
    if (bubble) bubble.classList.add("streaming");
  }
  if (!messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty muted";
    empty.textContent = "Ask anything. Conversations stay in this browser.";
    $("messages").append(empty);
  }
  $("messages").scrollTop = $("messages").scrollHeight;
}

function renderSidebar() {
  const items = store.list().map((conversation) => {
    const item = document.createElement("div");
    item.className = `conversation${conversation.id === store.currentId ? " active" : ""}`;
    item.dataset.id = conversation.id;
    const title = document.createElement("button");
    title.type = "button";
    title.className = "title";
    title.textContent = conversation.title;
    title.title = conversation.title;
    title.addEventListener("click", () => {
      saving(() => store.select(conversation.id));
      renderAll();
      showMenu(false);
    });
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "rename";
    rename.title = "Rename";
    rename.textContent = "✎";
    rename.addEventListener("click", () => startRename(item, conversation));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.title = "Delete";
    remove.textContent = "✕";
    // Two clicks delete: the first arms the button, so a stray click loses nothing.
    remove.addEventListener("click", () => {
      if (streaming && streaming.conversationId === conversation.id) return;
      if (!remove.classList.contains("armed")) {
        remove.classList.add("armed");
        remove.textContent = "Delete?";
        setTimeout(() => { remove.classList.remove("armed"); remove.textContent = "✕"; }, 3000);
        return;
      }
      saving(() => store.remove(conversation.id));
      renderAll();
    });
    item.append(title, rename, remove);
    return item;
  });
  $("conversation-list").replaceChildren(...items);
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

function startRename(item, conversation) {
  const input = document.createElement("input");
  input.type = "text";
  input.className = "rename-input";
  input.value = conversation.title;
  const finish = (isSaved) => {
    if (isSaved) saving(() => store.rename(conversation.id, input.value));
    renderSidebar();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") finish(true);
    if (event.key === "Escape") {
      event.stopPropagation(); // cancels the rename only; the drawer around it stays open
      finish(false);
    }
  });
  input.addEventListener("blur", () => finish(true));
  item.replaceChildren(input);
  input.focus();
  input.select();
}

function startEdit(bubble, index) {
  const message = store.current().messages[index];
  const editor = document.createElement("textarea");
  editor.className = "edit-input";
  editor.value = message.content;
  editor.rows = Math.min(12, message.content.split("\n").length + 1);
  const save = actionButton("Save & send", "save-edit", () => {
    const text = editor.value.trim();
    if (text) editAndResend(index, text);
  });
  const cancel = actionButton("Cancel", "cancel-edit", () => renderMessages());
  bubble.querySelector(".content").replaceChildren(editor);
  bubble.querySelector(".actions").replaceChildren(save, cancel);
  editor.focus();
}

function setBusy(isBusy) {
  document.body.classList.toggle("busy", isBusy);
  $("send").disabled = isBusy;
  $("stop").disabled = !isBusy;
}

// The sidebar as a drawer on a narrow screen (style.css shows it always on a wide one, where the
// menu button is hidden and this class changes nothing).
function showMenu(isShown) {
  document.body.classList.toggle("menu-open", isShown);
  $("open-menu").setAttribute("aria-expanded", String(isShown));
  if (isShown) $("new-chat").focus();
}

function showNotice(text) {
  $("notice").hidden = !text;
  $("notice").textContent = text || "";
}

// ---- sending ----

// The messages sent for a reply at `index`: the system prompt, then every earlier message with
// content (a reply that failed before writing anything is left out).
function historyFor(conversation, index, systemPrompt) {
  const history = systemPrompt ? [{ role: "system", content: systemPrompt }] : [];
  for (const message of conversation.messages.slice(0, index)) {
    // Prior thinking goes back with its turn: the model's template keeps or drops it.
    if (message.content) {
      history.push(message.reasoning ? { role: message.role, content: message.content,
                                         reasoning_content: message.reasoning }
        : { role: message.role, content: message.content });
    }
  }
  return history;
}

// Yields the parsed JSON of each `data:` event of an SSE body; stops at [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let boundary;
    while ((boundary = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, boundary);
      buffer = buffer.slice(boundary + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

// Streams the assistant message at `index` of `conversation` (already in its list, empty).
async function streamReply(conversation, index) {
  const message = conversation.messages[index];
  const model = $("model-picker").value || undefined;
  let settings;
  try {
    settings = requestOptions();
  } catch (err) {
    message.error = `settings: ${err.message}`;
    saving(() => store.touch(conversation));
    renderMessages();
    return;
  }
  const body = {
    model,
    messages: historyFor(conversation, index, settings.systemPrompt),
    ...settings.options,
    stream: true,
    stream_options: { include_usage: true },
  };
  const controller = new AbortController();
  streaming = { conversationId: conversation.id, index, controller };
  setBusy(true);
  renderAll();
  const bubbleIfShown = () => (store.currentId === conversation.id ? $("messages").children[index] : null);
  let renderTimer = null;
  let renderInterval = MIN_RENDER_INTERVAL_MS;
  const scheduleRender = () => {
    if (renderTimer !== null) return;
    renderTimer = setTimeout(() => {
      renderTimer = null;
      const bubble = bubbleIfShown();
      if (!bubble) return;
      const follow = isNearBottom();
      const renderStart = performance.now();
      fillThinking(bubble, message);
      renderMarkdown(bubble.querySelector(".content"), message.content);
      renderInterval = Math.max(MIN_RENDER_INTERVAL_MS, (performance.now() - renderStart) / MAX_RENDER_SHARE);
      if (follow) $("messages").scrollTop = $("messages").scrollHeight;
    }, renderInterval);
  };

  const startTime = performance.now();
  let firstTokenTime = null;
  let numTokens;
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (response.status === 401) showKeyBanner(true);
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) numTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const reasoning = choice.delta && choice.delta.reasoning_content;
        if (reasoning) {
          if (firstTokenTime === null) firstTokenTime = performance.now();
          message.reasoning = (message.reasoning || "") + reasoning;
          scheduleRender();
        }
        if (choice.delta && choice.delta.content) {
          if (firstTokenTime === null) firstTokenTime = performance.now();
          message.content += choice.delta.content;
          scheduleRender();
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
    // A reply came with the key as it is now: the header must not still ask for one.
    if ($("model-name").textContent === KEY_NEEDED) refreshServer();
  } catch (err) {
    if (err.name === "AbortError") finishReason = "stopped";
    else message.error = err.message;
  } finally {
    clearTimeout(renderTimer);
    streaming = null;
    setBusy(false);
  }
  const endTime = performance.now();
  const stats = { finish_reason: finishReason || undefined, model };
  if (firstTokenTime !== null) {
    stats.ttft_s = (firstTokenTime - startTime) / 1000;
    const decodeSeconds = (endTime - firstTokenTime) / 1000;
    if (numTokens !== undefined) stats.num_tokens = numTokens;
    if (numTokens > 1 && decodeSeconds > 0) stats.tokens_per_s = (numTokens - 1) / decodeSeconds;
  }
  message.stats = stats;
  saving(() => store.touch(conversation));
  renderAll();
}

function send(text) {
  const conversation = store.current() || saving(() => store.create()) || store.current();
  conversation.messages.push({ role: "user", content: text }, { role: "assistant", content: "" });
  saving(() => store.touch(conversation));
  return streamReply(conversation, conversation.messages.length - 1);
}

// A new reply in place of the one at `index`; everything after it goes.
function regenerate(index) {
  const conversation = store.current();
  conversation.messages.splice(index, conversation.messages.length - index, { role: "assistant", content: "" });
  saving(() => store.touch(conversation));
  return streamReply(conversation, index);
}

// The user message at `index` gets new text; the conversation after it is dropped and answered again.
function editAndResend(index, text) {
  const conversation = store.current();
  conversation.messages.splice(index, conversation.messages.length - index,
                               { role: "user", content: text }, { role: "assistant", content: "" });
  saving(() => store.touch(conversation));
  return streamReply(conversation, index + 1);
}

// ---- theme, export and import ----

function applyTheme() {
  const choice = loadSetting("theme") || "auto";
  const isDark = choice === "dark" || (choice === "auto" && window.matchMedia("(prefers-color-scheme: dark)").matches);
  document.documentElement.dataset.theme = isDark ? "dark" : "light";
  $("highlight-dark").disabled = !isDark;
  $("highlight-light").disabled = isDark;
  $("theme-toggle").textContent = `Theme: ${choice}`;
}

function download(fileName, text) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  link.download = fileName;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

async function importFile(file) {
  try {
    const count = store.importJson(await file.text());
    showNotice(`Imported ${count} conversation${count === 1 ? "" : "s"} from ${file.name}.`);
    renderAll();
  } catch (err) {
    showNotice(`Import failed: ${err.message}`);
  }
}

// ---- start ----

function init() {
  bindSettings((id) => {
    if (id === "api-key") {
      clearTimeout(keyTimer);
      keyTimer = setTimeout(refreshServer, 300);
    }
    try {
      requestOptions();
      $("settings-error").hidden = true;
    } catch (err) {
      $("settings-error").hidden = false;
      $("settings-error").textContent = err.message;
    }
  });
  const useBannerKey = () => {
    const key = $("key-banner-input").value.trim();
    if (!key) return;
    saveSetting("api-key", key);
    $("api-key").value = key;
    refreshServer();
  };
  $("key-banner-save").addEventListener("click", useBannerKey);
  $("key-banner-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter") useBannerKey();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value.trim();
    if (!text || streaming) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => streaming && streaming.controller.abort());
  $("model-picker").addEventListener("change", () => {
    saveSetting("model", $("model-picker").value);
    $("model-name").textContent = $("model-picker").value;
    showModelDefaults();
  });
  $("new-chat").addEventListener("click", () => {
    const current = store.current();
    if (!current || current.messages.length) saving(() => store.create());
    renderAll();
    showMenu(false);
    $("message").focus();
  });
  $("open-menu").addEventListener("click", () => showMenu(!document.body.classList.contains("menu-open")));
  $("sidebar-backdrop").addEventListener("click", () => showMenu(false));
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && document.body.classList.contains("menu-open")) showMenu(false);
  });
  $("open-settings").addEventListener("click", () => $("settings-dialog").showModal());
  $("reset-settings").addEventListener("click", () => {
    resetSettings();
    $("settings-error").hidden = true;
  });
  $("theme-toggle").addEventListener("click", () => {
    const choice = loadSetting("theme") || "auto";
    saveSetting("theme", THEMES[(THEMES.indexOf(choice) + 1) % THEMES.length]);
    applyTheme();
  });
  window.matchMedia("(prefers-color-scheme: dark)").addEventListener("change", applyTheme);
  $("export-chat").addEventListener("click", () => {
    const conversation = store.current();
    if (conversation) download(`tokios-chat-${conversation.id}.json`, store.exportJson([conversation]));
  });
  $("export-all").addEventListener("click", () => download("tokios-chats.json", store.exportJson(store.conversations)));
  $("import-chat").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", () => {
    const file = $("import-file").files[0];
    $("import-file").value = "";
    if (file) importFile(file);
  });
  if (!isMarkdownAvailable) {
    showNotice("Markdown rendering is off: this server has not installed the page's libraries "
               + "(run ./scripts/setup). Replies show as plain text.");
  }
  applyTheme();
  renderAll();
  refreshServer();
}

init();
