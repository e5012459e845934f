// The settings panel's fields: their defaults, how they are kept in localStorage, and how they
// become the fields of a /v1/chat/completions body. One table (FIELDS) serves all three, so a new
// sampling parameter is one line here and one input in index.html. Sampling fields start empty and
// an empty field is not sent: the server applies its own default for the model, which the field
// shows as its placeholder (showServerDefaults, from the model's /v1/models card).
"use strict";

const STORAGE_PREFIX = "tokios.";
// Version 1 of the stored settings wrote built-in sampling values into the fields (temperature 0.8,
// top-p 0.95, ...), which a reset stored as if typed. The move to version 2 forgets a stored value
// equal to its version-1 built-in, once; a value typed in afterwards is kept.
const SETTINGS_VERSION_KEY = STORAGE_PREFIX + "settings-version";
const SETTINGS_VERSION = "2";

// kind: how the input's text becomes a request value; param: the API field ("" when the field
// shapes the body in requestOptions instead of mapping onto one API field); value: the text a
// fresh browser starts from; oldDefault: what storage version 1 held for an untouched field.
export const FIELDS = [
  { id: "system-prompt", kind: "text", param: "", value: "" },
  { id: "temperature", kind: "number", param: "temperature", value: "", oldDefault: "0.8" },
  { id: "top-p", kind: "number", param: "top_p", value: "", oldDefault: "0.95" },
  { id: "top-k", kind: "integer", param: "top_k", value: "", oldDefault: "40" },
  { id: "min-p", kind: "number", param: "min_p", value: "", oldDefault: "0.05" },
  { id: "max-tokens", kind: "integer", param: "max_tokens", value: "512" },
  { id: "max-thinking-tokens", kind: "integer", param: "max_thinking_tokens", value: "" },
  { id: "min-tokens", kind: "integer", param: "min_tokens", value: "", oldDefault: "0" },
  { id: "presence-penalty", kind: "number", param: "presence_penalty", value: "", oldDefault: "0" },
  { id: "frequency-penalty", kind: "number", param: "frequency_penalty", value: "", oldDefault: "0" },
  { id: "repetition-penalty", kind: "number", param: "repetition_penalty", value: "", oldDefault: "1" },
  { id: "seed", kind: "integer", param: "seed", value: "" },
  { id: "stop-strings", kind: "lines", param: "stop", value: "" },
  { id: "logit-bias", kind: "json", param: "logit_bias", value: "" },
  { id: "response-format", kind: "text", param: "", value: "text" },
  { id: "json-schema", kind: "json", param: "", value: "" },
  { id: "speculative", kind: "text", param: "", value: "default" },
  { id: "api-key", kind: "text", param: "", value: "" },
];

function upgradeStoredSettings() {
  if (localStorage.getItem(SETTINGS_VERSION_KEY) === SETTINGS_VERSION) return;
  for (const field of FIELDS) {
    if (field.oldDefault !== undefined && localStorage.getItem(STORAGE_PREFIX + field.id) === field.oldDefault) {
      localStorage.removeItem(STORAGE_PREFIX + field.id);
    }
  }
  localStorage.setItem(SETTINGS_VERSION_KEY, SETTINGS_VERSION);
}

// A setting's saved text, else its default (null for a key no field has, such as "model").
export function loadSetting(id) {
  const saved = localStorage.getItem(STORAGE_PREFIX + id);
  if (saved !== null) return saved;
  const field = FIELDS.find((candidate) => candidate.id === id);
  return field ? field.value : null;
}

export function saveSetting(id, value) {
  localStorage.setItem(STORAGE_PREFIX + id, value);
}

// Fills the inputs from storage and keeps storage up to date as the user types ("input", not
// "change": a key pasted counts before the field loses focus). onChange(id) runs after each save.
export function bindSettings(onChange) {
  upgradeStoredSettings();
  for (const field of FIELDS) {
    const input = document.getElementById(field.id);
    input.dataset.pagePlaceholder = input.placeholder;
    input.value = loadSetting(field.id);
    const save = () => {
      saveSetting(field.id, input.value);
      onChange(field.id);
    };
    input.addEventListener("input", save);
    input.addEventListener("change", save);
  }
}

export function resetSettings() {
  for (const field of FIELDS) {
    if (field.id === "api-key") continue; // a reset of sampling must not forget the key
    document.getElementById(field.id).value = field.value;
    saveSetting(field.id, field.value);
  }
}

// Each empty field shows the server's default for its API field, from a /v1/models card's
// `sampling_defaults` (absent on a card that has none: the field keeps the page's own placeholder).
export function showServerDefaults(samplingDefaults) {
  for (const field of FIELDS) {
    if (!field.param) continue;
    const input = document.getElementById(field.id);
    const serverDefault = samplingDefaults ? samplingDefaults[field.param] : undefined;
    input.placeholder = typeof serverDefault === "number" ? String(serverDefault) : input.dataset.pagePlaceholder;
  }
}

function parseField(field, text) {
  const trimmed = text.trim();
  if (trimmed === "") return undefined;
  switch (field.kind) {
    case "number": {
      const value = Number(trimmed);
      if (!Number.isFinite(value)) throw new Error(`${field.id} must be a number, got ${JSON.stringify(text)}`);
      return value;
    }
    case "integer": {
      const value = Number(trimmed);
      if (!Number.isInteger(value)) throw new Error(`${field.id} must be a whole number, got ${JSON.stringify(text)}`);
      return value;
    }
    case "lines": {
      const lines = text.split("\n").filter((line) => line !== "");
      return lines.length ? lines : undefined;
    }
    case "json":
      try {
        return JSON.parse(trimmed);
      } catch (err) {
        throw new Error(`${field.id} is not valid JSON: ${err.message}`);
      }
    default:
      return trimmed;
  }
}

// The request fields the settings ask for (everything but model, messages and stream). Throws an
// Error naming the setting when one cannot be read, so nothing is sent with a setting dropped.
export function requestOptions() {
  const values = {};
  for (const field of FIELDS) values[field.id] = parseField(field, loadSetting(field.id));
  const options = {};
  for (const field of FIELDS) {
    if (field.param && values[field.id] !== undefined) options[field.param] = values[field.id];
  }
  if (options.logit_bias !== undefined && (typeof options.logit_bias !== "object" || Array.isArray(options.logit_bias))) {
    throw new Error("logit-bias must be a JSON object of token id to bias");
  }
  const format = values["response-format"] || "text";
  if (format === "json_object") {
    options.response_format = { type: "json_object" };
  } else if (format === "json_schema") {
    const schema = values["json-schema"];
    if (schema === undefined) throw new Error("json-schema is empty: give a schema or pick another format");
    options.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
  }
  const speculative = values.speculative || "default";
  if (speculative !== "default") options.speculative = { method: speculative };
  return { systemPrompt: values["system-prompt"], options };
}
