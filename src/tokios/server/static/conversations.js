// Conversations kept in this browser (localStorage): create, rename, delete, and the JSON format
// of export and import. A conversation is {id, title, created, updated, messages}; a message is
// {role: "user" | "assistant", content, stats?, error?}. Imported files are checked field by field
// and every imported conversation gets a fresh id, so an import never overwrites what is here.
"use strict";

const CONVERSATIONS_KEY = "tokios.conversations";
const CURRENT_KEY = "tokios.current-conversation";
export const EXPORT_FORMAT = "tokios-conversations";
const TITLE_LENGTH = 48;

function newId() {
  return `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
}

export class ConversationStore {
  constructor() {
    this.conversations = [];
    try {
      const saved = JSON.parse(localStorage.getItem(CONVERSATIONS_KEY) || "[]");
      this.conversations = Array.isArray(saved) ? saved.filter((item) => item && Array.isArray(item.messages)) : [];
    } catch (_) {
      this.conversations = []; // unreadable storage is started afresh rather than breaking the page
    }
    this.currentId = localStorage.getItem(CURRENT_KEY);
    if (!this.get(this.currentId)) this.currentId = this.conversations.length ? this.conversations[0].id : null;
  }

  get(id) {
    return this.conversations.find((conversation) => conversation.id === id) || null;
  }

  current() {
    return this.get(this.currentId);
  }

  // Most recently updated first, as the sidebar lists them.
  list() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  // Throws an Error saying the browser's storage is full (the conversations stay in memory).
  save() {
    try {
      localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(this.conversations));
      if (this.currentId) localStorage.setItem(CURRENT_KEY, this.currentId);
      else localStorage.removeItem(CURRENT_KEY);
    } catch (err) {
      throw new Error(`this browser's storage refused the conversations (${err.name}): delete or export some`);
    }
  }

  create() {
    const now = Date.now();
    const conversation = { id: newId(), title: "New chat", created: now, updated: now, messages: [] };
    this.conversations.push(conversation);
    this.currentId = conversation.id;
    this.save();
    return conversation;
  }

  select(id) {
    if (this.get(id)) {
      this.currentId = id;
      this.save();
    }
  }

  rename(id, title) {
    const conversation = this.get(id);
    const trimmed = title.trim();
    if (conversation && trimmed) {
      conversation.title = trimmed;
      conversation.isTitleSet = true;
      this.save();
    }
  }

  remove(id) {
    this.conversations = this.conversations.filter((conversation) => conversation.id !== id);
    if (this.currentId === id) this.currentId = this.conversations.length ? this.list()[0].id : null;
    this.save();
  }

  // Called after messages change: the title follows the first user message until renamed.
  touch(conversation) {
    conversation.updated = Date.now();
    const first = conversation.messages.find((message) => message.role === "user");
    if (!conversation.isTitleSet && first) {
      const line = first.content.trim().split("\n")[0];
      conversation.title = line.length > TITLE_LENGTH ? `${line.slice(0, TITLE_LENGTH - 1)}…` : line || "New chat";
    }
    this.save();
  }

  exportJson(conversations) {
    return JSON.stringify({ format: EXPORT_FORMAT, version: 1, conversations }, null, 2);
  }

  // Adds the conversations of an exported file (this page's format, a bare list, or one
  // conversation). Returns how many were added; throws an Error naming the first bad field.
  importJson(text) {
    let data;
    try {
      data = JSON.parse(text);
    } catch (err) {
      throw new Error(`the file is not JSON: ${err.message}`);
    }
    const items = Array.isArray(data) ? data
      : data && Array.isArray(data.conversations) ? data.conversations
        : [data];
    const imported = items.map((item, index) => checkedConversation(item, `conversations[${index}]`));
    if (!imported.length) throw new Error("the file holds no conversations");
    const now = Date.now();
    const previous = { conversations: this.conversations, currentId: this.currentId };
    imported.forEach((conversation, index) => {
      conversation.id = newId();
      conversation.updated = conversation.updated || now - index;
    });
    this.conversations = [...this.conversations, ...imported];
    this.currentId = imported[0].id;
    try {
      this.save();
    } catch (err) {
      Object.assign(this, previous); // an import that cannot be kept adds nothing
      throw err;
    }
    return imported.length;
  }
}

// The stats fields the page shows, each kept only with the type it is shown as.
const STAT_FIELD_TO_TYPE = { ttft_s: "number", tokens_per_s: "number", num_tokens: "number",
                             finish_reason: "string", model: "string" };

function checkedStats(stats) {
  if (!stats || typeof stats !== "object") return null;
  const kept = {};
  for (const [field, type] of Object.entries(STAT_FIELD_TO_TYPE)) {
    const value = stats[field];
    if (typeof value === type && (type !== "number" || Number.isFinite(value))) kept[field] = value;
  }
  return kept;
}

function checkedConversation(item, where) {
  if (!item || typeof item !== "object" || Array.isArray(item)) throw new Error(`${where} must be an object`);
  if (!Array.isArray(item.messages)) throw new Error(`${where}.messages must be a list`);
  const messages = item.messages.map((message, index) => {
    const at = `${where}.messages[${index}]`;
    if (!message || typeof message !== "object") throw new Error(`${at} must be an object`);
    if (message.role !== "user" && message.role !== "assistant") {
      throw new Error(`${at}.role must be "user" or "assistant", got ${JSON.stringify(message.role)}`);
    }
    if (typeof message.content !== "string") throw new Error(`${at}.content must be a string`);
    const kept = { role: message.role, content: message.content };
    if (typeof message.error === "string") kept.error = message.error;
    const stats = checkedStats(message.stats);
    if (stats) kept.stats = stats;
    return kept;
  });
  const now = Date.now();
  return {
    title: typeof item.title === "string" && item.title.trim() ? item.title.trim() : "Imported chat",
    isTitleSet: typeof item.title === "string" && item.title.trim() !== "",
    created: Number.isFinite(item.created) ? item.created : now,
    updated: Number.isFinite(item.updated) ? item.updated : 0,
    messages,
  };
}
