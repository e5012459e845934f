// The tokios web chat: keeps the conversation, streams answers from /v1/chat/completions over
// SSE (fetch + a small parser, no library, no build step), shows TTFT and tokens per second.
// The API key, the sampling settings and the system prompt are kept in localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], model: null, controller: null };
const STORED_FIELDS = ["api-key", "temperature", "top-p", "top-k", "min-p", "max-tokens", "system-prompt"];
const KEY_NEEDED = "API key needed";

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  bubble.textContent = text;
  $("messages").appendChild(bubble);
  $("messages").scrollTop = $("messages").scrollHeight;
  return bubble;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

function pickModel() {
  state.model = $("model-picker").value;
  $("model-name").textContent = state.model;
}

async function refreshServer() {
  try {
    const health = await fetch("/health");
    $("server-status").textContent = health.ok ? "ready" : (await health.json()).status;
    $("server-status").className = `badge ${health.ok ? "ok" : "bad"}`;
    const models = await fetch("/v1/models", { headers: authHeaders() });
    if (models.ok) {
      const cards = (await models.json()).data;
      const picker = $("model-picker");
      const chosen = state.model && cards.some((card) => card.id === state.model) ? state.model : cards[0].id;
      picker.replaceChildren(...cards.map((card) => {
        const option = document.createElement("option");
        option.value = card.id;
        option.textContent = card.state === "loaded" ? card.id : `${card.id} (${card.state})`;
        return option;
      }));
      picker.value = chosen;
      state.model = chosen;
      $("model-name").textContent = state.model;
    } else {
      $("model-name").textContent = models.status === 401 ? KEY_NEEDED : await errorText(models);
    }
  } catch (err) {
    $("server-status").textContent = "offline";
    $("server-status").className = "badge bad";
  }
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

function setBusy(isBusy) {
  $("send").disabled = isBusy;
  $("stop").disabled = !isBusy;
}

async function send(text) {
  const system = $("system-prompt").value.trim();
  state.messages.push({ role: "user", content: text });
  addBubble("user", text);
  const bubble = addBubble("assistant streaming", "");
  const body = {
    model: state.model || undefined,
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    top_k: Number($("top-k").value),
    min_p: Number($("min-p").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  state.controller = new AbortController();
  setBusy(true);
  const startTime = performance.now();
  let firstTokenTime = null;
  let numTokens = 0;
  let answer = "";
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) numTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          if (firstTokenTime === null) firstTokenTime = performance.now();
          answer += choice.delta.content;
          bubble.textContent = answer;
          $("messages").scrollTop = $("messages").scrollHeight;
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    }
    state.messages.push({ role: "assistant", content: answer });
    // A reply came with the key as it is now: the header must not still ask for one.
    if ($("model-name").textContent === KEY_NEEDED) refreshServer();
  } catch (err) {
    if (err.name === "AbortError") {
      finishReason = "stopped";
      if (answer) state.messages.push({ role: "assistant", content: answer });
    } else {
      addBubble("error", `Error: ${err.message}`);
      state.messages.pop(); // the question was not answered; let the user resend it
    }
  } finally {
    bubble.classList.remove("streaming");
    if (!answer) bubble.remove();
    setBusy(false);
    state.controller = null;
  }
  const endTime = performance.now();
  if (firstTokenTime !== null) {
    const ttft = (firstTokenTime - startTime) / 1000;
    const decodeSeconds = (endTime - firstTokenTime) / 1000;
    const rate = numTokens > 1 && decodeSeconds > 0 ? ((numTokens - 1) / decodeSeconds).toFixed(1) : "–";
    $("stats").textContent = `TTFT ${ttft.toFixed(2)} s · ${rate} tok/s · ${numTokens} tokens · ${finishReason || ""}`;
  }
}

function init() {
  let keyTimer = null;
  for (const id of STORED_FIELDS) {
    const saved = localStorage.getItem(`tokios.${id}`);
    if (saved !== null) $(id).value = saved;
    // "input", not only "change": a key typed or pasted counts before the field loses focus.
    $(id).addEventListener("input", () => {
      localStorage.setItem(`tokios.${id}`, $(id).value);
      if (id === "api-key") {
        clearTimeout(keyTimer);
        keyTimer = setTimeout(refreshServer, 300);
      }
    });
  }
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.controller) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("model-picker").addEventListener("change", pickModel);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    $("messages").replaceChildren();
    $("stats").textContent = "";
  });
  refreshServer();
}

init();
