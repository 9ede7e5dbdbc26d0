// The chat playground: streams /v1/chat/completions (SSE) like any OpenAI client, with the API
// key when the server has one. The conversation lives in this browser (localStorage) only.
"use strict";

const CONVERSATION_STORE = "baton-conversation";
const $ = (id) => document.getElementById(id);

const state = {
  model: null,
  messages: loadConversation(),
  controller: null,
};

function loadConversation() {
  try {
    const saved = JSON.parse(localStorage.getItem(CONVERSATION_STORE) || "[]");
    return Array.isArray(saved) ? saved : [];
  } catch (e) {
    return []; // an unreadable save starts a new conversation
  }
}

function saveConversation() {
  localStorage.setItem(CONVERSATION_STORE, JSON.stringify(state.messages));
}

// One message's block in the page; returns its parts for streaming into.
function addMessage(role, text) {
  $("empty").classList.add("hidden");
  const box = element("div", "message " + role);
  box.dataset.role = role;
  box.appendChild(element("div", "role", role));
  const reasoning = element("div", "reasoning hidden");
  const content = element("div", "content", text || "");
  const tools = element("div", "tools");
  const stats = element("div", "stats");
  box.append(reasoning, content, tools, stats);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return { box, reasoning, content, tools, stats };
}

function renderConversation() {
  for (const node of [...$("messages").querySelectorAll(".message")]) node.remove();
  $("empty").classList.toggle("hidden", state.messages.length > 0);
  for (const m of state.messages) {
    const parts = addMessage(m.role, m.content || "");
    for (const call of m.tool_calls || []) showToolCall(parts.tools, call);
  }
}

function showToolCall(container, call) {
  const node = element("div", "tool-call");
  node.textContent = "tool call: " + call.function.name + "(" + call.function.arguments + ")";
  container.appendChild(node);
}

function parseJson(id, what) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(what + " is not valid JSON: " + e.message);
  }
}

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

// The request body from the settings (fields left empty are not sent).
function requestBody() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.messages);
  const body = {
    model: state.model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) body.stop = stop;
  const schema = $("schema-field").classList.contains("hidden")
    ? undefined
    : parseJson("json-schema", "The JSON schema");
  if (schema !== undefined) {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
  }
  const tools = parseJson("tools", "Tools");
  if (tools !== undefined) body.tools = tools;
  const extra = parseJson("extra", "Other parameters");
  if (extra !== undefined) Object.assign(body, extra);
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("new-chat").disabled = busy;
  $("stop-button").disabled = !busy;
}

// The data lines of a server-sent-events stream, as they arrive.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }
}

function describeAnswer(a) {
  const parts = [];
  if (a.usage) {
    parts.push(a.usage.prompt_tokens + " prompt tokens", a.usage.completion_tokens + " completion tokens");
  } else {
    parts.push("≈" + a.chunks + " completion tokens");
  }
  parts.push("TTFT " + formatSeconds(a.ttft));
  const tokens = a.usage ? a.usage.completion_tokens : a.chunks;
  if (a.decodeSeconds > 0 && tokens > 1) {
    parts.push(((tokens - 1) / a.decodeSeconds).toFixed(1) + " tok/s");
  }
  if (a.stopped) parts.push("stopped");
  else if (a.finishReason) parts.push("finish: " + a.finishReason);
  return parts.join(" · ");
}

// Runs ``draw`` at most once per animation frame however often ``request`` is called: a fast
// stream (a small model writes over a thousand tokens a second) would otherwise rewrite and lay
// out the whole answer per token, which grows with the answer and keeps the page from responding.
function frameRenderer(draw) {
  let pending = false;
  return {
    request() {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        if (!pending) return;
        pending = false;
        draw();
      });
    },
    now() {
      pending = false;
      draw();
    },
  };
}

// The answer so far, as one write per element.
function showAnswer(parts, answer) {
  if (answer.error !== null) {
    parts.box.classList.add("error");
    parts.content.textContent = (answer.content ? answer.content + "\n\n" : "") + "Error: " + answer.error;
  } else {
    parts.content.textContent = answer.content;
  }
  if (answer.reasoning) {
    parts.reasoning.textContent = answer.reasoning;
    parts.reasoning.classList.remove("hidden");
  }
  parts.stats.textContent = describeAnswer(answer);
  parts.box.scrollIntoView({ block: "end" });
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  $("settings-error").textContent = "";
  state.messages.push({ role: "user", content: text });
  let body;
  try {
    body = requestBody();
  } catch (e) {
    state.messages.pop();
    $("settings-error").textContent = e.message;
    return;
  }
  $("prompt").value = "";
  addMessage("user", text);
  saveConversation();
  const parts = addMessage("assistant", "");
  const answer = { content: "", reasoning: "", toolCalls: [], chunks: 0, usage: null,
    ttft: null, decodeSeconds: 0, finishReason: null, stopped: false, error: null };
  const render = frameRenderer(() => showAnswer(parts, answer));
  state.controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let firstAt = null;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) answer.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content || delta.tool_calls) {
        if (firstAt === null) {
          firstAt = performance.now();
          answer.ttft = (firstAt - started) / 1000;
        }
        answer.chunks += 1;
        answer.decodeSeconds = (performance.now() - firstAt) / 1000;
      }
      if (delta.content) answer.content += delta.content;
      if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls || []) {
        const slot = (answer.toolCalls[call.index] = answer.toolCalls[call.index] ||
          { id: call.id, type: "function", function: { name: "", arguments: "" } });
        if (call.function && call.function.name) slot.function.name += call.function.name;
        if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
      }
      if (choice.finish_reason) answer.finishReason = choice.finish_reason;
      render.request();
    }
  } catch (e) {
    if (e.name === "AbortError") {
      answer.stopped = true;
    } else {
      answer.error = e.message;
    }
  } finally {
    state.controller = null;
    setBusy(false);
  }
  render.now();
  parts.tools.replaceChildren();
  for (const call of answer.toolCalls) showToolCall(parts.tools, call);
  parts.box.dataset.done = answer.stopped ? "stopped" : "finished";
  if (answer.content || answer.toolCalls.length) {
    const message = { role: "assistant", content: answer.content };
    if (answer.toolCalls.length) message.tool_calls = answer.toolCalls;
    state.messages.push(message);
    saveConversation();
  }
}

function stop() {
  // aborting the fetch closes the connection: the server aborts the request in the engine
  if (state.controller) state.controller.abort();
}

function newChat() {
  state.messages = [];
  saveConversation();
  renderConversation();
}

async function start() {
  $("send").addEventListener("click", send);
  $("stop-button").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      send();
    }
  });
  renderConversation();
  const response = await apiFetch("/ui/info");
  if (!response.ok) {
    $("settings-error").textContent = "The server's info: " + (await errorText(response));
    return;
  }
  const info = await response.json();
  state.model = info.model;
  $("model-name").textContent = info.model;
  $("schema-field").classList.toggle("hidden", !info.structured_output);
  document.body.dataset.ready = "true";
}

document.addEventListener("DOMContentLoaded", start);
