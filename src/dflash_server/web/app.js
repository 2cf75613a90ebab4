// The dflash-server chat page: streams /v1/chat/completions and shows what speculation did.
// No framework, no build step. State lives in localStorage (conversation, settings, API key).

import { Attachments, imageFiles, imagesHtml, userContent } from "./images.js";
import { renderMarkdown } from "./markdown.js";
import { assistantHtml } from "./views.js";

const $ = (id) => document.getElementById(id);
// Settings v2 keep only what the user set; the first version kept every field, so a stored
// temperature or thinking switch could not tell a choice from the page's old defaults.
const KEYS = {
  apiKey: "dflash.apiKey", settings: "dflash.settings.v2", chat: "dflash.conversation",
  model: "dflash.model",
};

const state = {
  model: null, // served model id, from /health
  messages: loadJson(KEYS.chat, []),
  controller: null, // AbortController of the running request
  views: new Map(), // message object -> its <article>
  attachments: null, // the images of the next message (images.js)
};

function loadJson(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

function saveChat() {
  try {
    localStorage.setItem(KEYS.chat, JSON.stringify(state.messages));
  } catch {
    // Images can outgrow the browser's storage (a few MB): keep the conversation's text.
    const text = state.messages.map((m) => (m.images && m.images.length
      ? { ...m, images: [], imagesLost: m.images.length } : m));
    localStorage.setItem(KEYS.chat, JSON.stringify(text));
  }
}

// ----- settings ------------------------------------------------------------------------------

// Empty (or "server default") leaves a setting to the server: only what the user set is sent.
const fields = ["thinking", "temperature", "block-size", "max-tokens", "tools"];

function loadSettings() {
  $("api-key").value = localStorage.getItem(KEYS.apiKey) || "";
  const saved = loadJson(KEYS.settings, {});
  for (const id of fields) if (typeof saved[id] === "string") $(id).value = saved[id];
  $("settings").open = window.matchMedia("(min-width: 56rem)").matches;
}

function saveSettings() {
  localStorage.setItem(KEYS.apiKey, $("api-key").value.trim());
  const values = {};
  for (const id of fields) if ($(id).value !== "") values[id] = $(id).value;
  localStorage.setItem(KEYS.settings, JSON.stringify(values));
}

// The server's defaults (GET /health), shown where a setting is left to them.
function showDefaults(d) {
  $("thinking").options[0].textContent = `server default (${d.enable_thinking ? "on" : "off"})`;
  $("temperature").placeholder = `server default: ${d.temperature}`;
  const block = d.speculative === false ? "plain decoding" : d.block_size;
  $("block-size").placeholder = `server default: ${block}`;
  $("max-tokens").placeholder = `server default: ${d.max_tokens ?? "no limit"}`;
}

function positiveInt(id) {
  const n = Number.parseInt($(id).value, 10);
  return Number.isFinite(n) && n > 0 ? n : null;
}

// ----- server status -------------------------------------------------------------------------

async function pollHealth() {
  let retry = 2000;
  try {
    const res = await fetch("/health");
    const body = await res.json();
    const chosen = localStorage.getItem(KEYS.model);
    state.model = (body.models || []).includes(chosen) ? chosen : (body.models || [])[0] || null;
    if ((body.models || []).length > 1) listModels();
    if (body.block_size) $("block-size").max = String(body.block_size);
    if (body.defaults) showDefaults(body.defaults);
    state.attachments.configure(body);
    $("attach").disabled = !body.vision;
    $("attach").title = body.vision ? "Attach images (PNG, JPEG, WebP, GIF)"
      : "This model takes no images";
    const parts = [state.model, body.block_size && `block ${body.block_size}`, body.status];
    $("server-status").textContent = parts.filter(Boolean).join(" · ");
    if (res.ok) retry = 0;
    if (body.status === "failed") retry = 0;
  } catch {
    $("server-status").textContent = "server unreachable, retrying…";
  }
  if (retry) setTimeout(pollHealth, retry);
}

// The model menu (a server with several models): its chat models, each with its state; the
// choice is kept in this browser. An unloaded model loads when a message is sent to it.
async function listModels() {
  const headers = {};
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const res = await fetch("/v1/models", { headers });
    if (!res.ok) return;
    const chat = (await res.json()).data.filter((m) => m.kind !== "embeddings");
    const menu = $("model-select");
    menu.replaceChildren(...chat.map((m) => {
      const option = document.createElement("option");
      option.value = m.id;
      option.textContent = m.state && m.state !== "loaded" ? `${m.id} (${m.state})` : m.id;
      option.selected = m.id === state.model;
      return option;
    }));
    menu.hidden = chat.length < 2;
  } catch {
    // the status line already says when the server is unreachable
  }
}

function chooseModel() {
  state.model = $("model-select").value;
  localStorage.setItem(KEYS.model, state.model);
  $("server-status").textContent = `${state.model} · chosen`;
}

// ----- rendering -----------------------------------------------------------------------------

function render() {
  const box = $("messages");
  box.querySelectorAll("article").forEach((el) => el.remove());
  state.views.clear();
  $("empty").hidden = state.messages.length > 0;
  for (const msg of state.messages) box.append(view(msg));
  box.scrollTop = box.scrollHeight;
}

const FOLDS = [["details.reasoning", "reasoningOpen"], ["details.tokens", "tokensOpen"]];

function view(msg) {
  let el = state.views.get(msg);
  if (!el) {
    el = document.createElement("article");
    el.className = `msg ${msg.role}`;
    state.views.set(msg, el);
  }
  el.setAttribute("aria-busy", msg.streaming ? "true" : "false");
  if (msg.role === "user") {
    el.innerHTML = `<h2 class="visually-hidden">You</h2>${imagesHtml(msg)}` +
      `<div class="md">${renderMarkdown(msg.content)}</div>`;
    return el;
  }
  el.innerHTML = assistantHtml(msg);
  // Bar heights go through the CSSOM: the page's CSP forbids inline style attributes.
  el.querySelectorAll(".bar").forEach((bar) => bar.style.setProperty("--h", `${bar.dataset.h}%`));
  // Folded parts stay as the user left them across re-renders: the user decides from then on.
  for (const [selector, key] of FOLDS) {
    const details = el.querySelector(selector);
    if (!details) continue;
    details.querySelector("summary").addEventListener("click", () => { msg[key] = !details.open; });
  }
  return el;
}

let pending = null;
function scheduleUpdate(msg) {
  if (pending) return;
  pending = requestAnimationFrame(() => {
    pending = null;
    update(msg);
  });
}

function update(msg) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  view(msg);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

// ----- requests ------------------------------------------------------------------------------

function requestBody() {
  const history = [];
  for (const m of state.messages) {
    if (m.role === "user") history.push({ role: "user", content: userContent(m) });
    else if (m.content && !m.streaming) history.push({ role: "assistant", content: m.content });
  }
  const body = {
    messages: history,
    stream: true,
    stream_options: { include_usage: true },
    dflash_tokens: true, // our stream extension: each token's text and source (draft/suffix/target)
  };
  if (state.model) body.model = state.model;
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = { enable_thinking: thinking === "on" };
  const temperature = Number.parseFloat($("temperature").value);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const block = positiveInt("block-size");
  if (block) body.block_size = block;
  const maxTokens = positiveInt("max-tokens");
  if (maxTokens) body.max_tokens = maxTokens;
  const tools = $("tools").value.trim();
  if (tools) body.tools = JSON.parse(tools); // checked in send()
  return body;
}

async function describeError(res) {
  let message = res.statusText || "request failed";
  try {
    const body = await res.json();
    message = (body.error && body.error.message) || JSON.stringify(body);
  } catch { /* not JSON */ }
  const hints = {
    401: "Enter the server's API key in Settings.",
    429: "The server is busy; try again in a moment.",
    503: "The model is still loading, or the server is shutting down.",
  };
  return { status: res.status, message, hint: hints[res.status] || "" };
}

// Calls onData for every `data:` payload of an SSE response until `[DONE]`.
async function readEvents(res, onData) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue; // keepalive comment
      if (data === "[DONE]") return;
      onData(JSON.parse(data));
    }
  }
}

function onChunk(msg, chunk, started) {
  if (chunk.error) {
    msg.error = { status: null, message: `${chunk.error.message} (${chunk.error.code || "error"})` };
    return;
  }
  if (chunk.usage) msg.usage = chunk.usage;
  if (chunk.dflash) msg.dflash = chunk.dflash;
  if (Array.isArray(chunk.dflash_tokens)) (msg.tokens ||= []).push(...chunk.dflash_tokens);
  const choice = (chunk.choices || [])[0];
  if (!choice) return;
  const delta = choice.delta || {};
  const reasoning = delta.reasoning_content ?? delta.reasoning;
  if (reasoning) msg.reasoning += reasoning;
  if (delta.content) msg.content += delta.content;
  for (const call of delta.tool_calls || []) {
    const i = call.index ?? msg.toolCalls.length;
    const fn = call.function || {};
    const known = msg.toolCalls[i] || (msg.toolCalls[i] = { name: "", arguments: "" });
    if (fn.name) known.name = fn.name;
    if (fn.arguments) known.arguments += fn.arguments;
  }
  if (msg.ttft == null && (reasoning || delta.content || delta.tool_calls)) {
    msg.ttft = performance.now() - started;
  }
  if (choice.finish_reason) msg.finish = choice.finish_reason;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text, images) {
  let body;
  try {
    body = requestBody();
    $("tools").removeAttribute("aria-invalid");
  } catch (err) {
    $("tools").setAttribute("aria-invalid", "true");
    $("settings").open = true;
    state.messages.push({ role: "assistant", content: "", error: { message: `Tools field: ${err.message}` } });
    render();
    return;
  }
  const reply = { role: "assistant", content: "", reasoning: "", toolCalls: [], streaming: true };
  const question = { role: "user", content: text, images };
  state.messages.push(question, reply);
  body.messages.push({ role: "user", content: userContent(question) });
  render();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      reply.error = await describeError(res);
      if (res.status === 401) $("settings").open = true;
    } else {
      await readEvents(res, (chunk) => {
        onChunk(reply, chunk, started);
        scheduleUpdate(reply);
      });
    }
  } catch (err) {
    if (err.name === "AbortError") reply.stopped = true;
    else reply.error = { status: null, message: `cannot reach the server (${err.message})` };
  } finally {
    reply.streaming = false;
    reply.elapsed = performance.now() - started;
    state.controller = null;
    setBusy(false);
    saveChat();
    update(reply);
  }
}

function stop() {
  if (state.controller) state.controller.abort(); // the server stops generating at once
}

function newChat() {
  stop();
  state.messages = [];
  saveChat();
  render();
  $("prompt").focus();
}

// ----- wiring --------------------------------------------------------------------------------

// Images come from the button, a paste into the message box, or a drop on the conversation.
function wireImages() {
  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", async (e) => {
    await state.attachments.add(Array.from(e.target.files));
    e.target.value = ""; // the same file may be chosen again
  });
  $("prompt").addEventListener("paste", (e) => {
    const files = imageFiles(e.clipboardData);
    if (!files.length) return; // text pastes as usual
    e.preventDefault();
    state.attachments.add(files);
  });
  const area = document.querySelector("main.chat");
  area.addEventListener("dragover", (e) => {
    e.preventDefault();
    $("composer").classList.add("dropping");
  });
  area.addEventListener("dragleave", () => $("composer").classList.remove("dropping"));
  area.addEventListener("drop", (e) => {
    e.preventDefault();
    $("composer").classList.remove("dropping");
    state.attachments.add(imageFiles(e.dataTransfer));
  });
}

function init() {
  state.attachments = new Attachments($("attachments"), $("attach-note"));
  for (const m of state.messages) {
    if (m.streaming) Object.assign(m, { streaming: false, stopped: true }); // page closed mid-answer
  }
  loadSettings();
  render();
  $("settings-form").addEventListener("input", saveSettings);
  $("settings-form").addEventListener("submit", (e) => e.preventDefault());
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    const attached = state.attachments.items.length > 0;
    if ((!text && !attached) || state.controller) return;
    $("prompt").value = "";
    send(text, state.attachments.take());
  });
  wireImages();
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.controller) stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("model-select").addEventListener("change", chooseModel);
  $("model-select").addEventListener("focus", listModels);
  pollHealth();
}

init();
