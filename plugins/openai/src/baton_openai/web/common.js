// Shared by baton's pages: the API key (asked for when a route answers 401, kept for this tab
// only, sent as "Authorization: Bearer" like any client), fetch with it, small DOM helpers.
"use strict";

const KEY_STORE = "baton-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

let keyPrompt = null; // the key dialog's pending answer, shared by every request that waits

// Opens the page's key dialog; resolves once a key is entered.
function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  dialog.querySelector(".key-message").textContent = message;
  if (keyPrompt) {
    if (!dialog.open) dialog.showModal(); // closed with Escape: the requests still wait
    return keyPrompt;
  }
  const form = dialog.querySelector("form");
  const input = dialog.querySelector("input");
  input.value = "";
  keyPrompt = new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_STORE, input.value.trim());
      keyPrompt = null;
      dialog.close();
      resolve();
    };
  });
  dialog.showModal();
  input.focus();
  return keyPrompt;
}

// fetch() with the key; a 401 asks for a key and tries again.
async function apiFetch(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401) return response;
    await askForKey(
      apiKey()
        ? "The server refused this API key. Enter the right one:"
        : "This server needs an API key. Enter it:"
    );
  }
}

// The message of an error answer (OpenAI's {"error": {"message"}}), else its status.
async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) {
    // not JSON: the status line says enough
  }
  return response.status + " " + response.statusText;
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return (seconds * 1000).toFixed(seconds < 0.01 ? 2 : 0) + " ms";
  return seconds.toFixed(2) + " s";
}

function formatDuration(seconds) {
  const s = Math.floor(seconds);
  const d = Math.floor(s / 86400);
  const h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60);
  const parts = d ? [d + "d", h + "h", m + "m"] : h ? [h + "h", m + "m"] : [m + "m"];
  return parts.join(" ") + " " + (s % 60) + "s";
}

function formatPercent(fraction) {
  return fraction === null || fraction === undefined ? "–" : (fraction * 100).toFixed(1) + " %";
}

function formatRate(value) {
  return value === null || value === undefined ? "–" : value.toFixed(1);
}

document.addEventListener("DOMContentLoaded", () => {
  const button = document.getElementById("key-button");
  if (button) {
    button.addEventListener("click", () =>
      askForKey("API key for this server:").then(() => location.reload())
    );
  }
});
