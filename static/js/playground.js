// The playground: a chat completion streamed from /v1 (SSE over fetch), token by token.
"use strict";
(function () {
  let mintedKey = null; // kept in memory only; a reload mints a new one
  let controller = null;

  function csrfToken() {
    const headers = JSON.parse(document.body.getAttribute("hx-headers") || "{}");
    return headers["X-CSRFToken"];
  }

  async function apiKey(form) {
    const pasted = document.getElementById("pg-key").value.trim();
    if (pasted) return pasted;
    if (mintedKey) return mintedKey;
    const url = form.dataset.mintUrl;
    if (!url) throw new Error("Paste an API key: your role cannot mint one.");
    const reply = await fetch(url, { method: "POST", headers: { "X-CSRFToken": csrfToken() }, credentials: "same-origin" });
    const body = await reply.json();
    if (!reply.ok) throw new Error(body.error || `Could not mint a key (${reply.status}).`);
    mintedKey = body.key;
    return mintedKey;
  }

  // One SSE event per "\n\n"; each `data:` line is a chunk or [DONE].
  function* events(buffer) {
    let cut;
    while ((cut = buffer.text.indexOf("\n\n")) >= 0) {
      const block = buffer.text.slice(0, cut);
      buffer.text = buffer.text.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }

  async function send(form) {
    const output = document.getElementById("pg-output");
    const status = document.getElementById("pg-status");
    const meta = document.getElementById("pg-meta");
    output.textContent = "";
    output.dataset.chunks = "0";
    output.dataset.done = "false";
    meta.textContent = "";
    status.textContent = "connecting…";
    const key = await apiKey(form);
    controller = new AbortController();
    document.getElementById("pg-stop").disabled = false;
    const started = performance.now();
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      signal: controller.signal,
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
      body: JSON.stringify({
        model: document.getElementById("pg-model").value,
        messages: [{ role: "user", content: document.getElementById("pg-prompt").value }],
        max_tokens: Number(document.getElementById("pg-max-tokens").value),
        stream: true,
        stream_options: { include_usage: true },
      }),
    });
    if (!reply.ok) {
      const body = await reply.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${reply.status}`);
    }
    output.dataset.requestId = reply.headers.get("x-request-id") || "";
    status.textContent = "streaming…";
    const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
    const buffer = { text: "" };
    let firstTokenMs = null;
    let usage = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer.text += value;
      for (const data of events(buffer)) {
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
        if (delta && delta.content) {
          if (firstTokenMs === null) firstTokenMs = performance.now() - started;
          output.append(document.createTextNode(delta.content));
          output.dataset.chunks = String(Number(output.dataset.chunks) + 1);
        }
      }
    }
    output.dataset.done = "true";
    status.textContent = "done";
    const parts = [];
    if (firstTokenMs !== null) parts.push(`first token after ${Math.round(firstTokenMs)} ms`);
    parts.push(`${output.dataset.chunks} chunks`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    meta.textContent = parts.join(" · ");
  }

  document.addEventListener("DOMContentLoaded", () => {
    const form = document.getElementById("playground");
    const stop = document.getElementById("pg-stop");
    stop.addEventListener("click", () => controller && controller.abort());
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const button = document.getElementById("pg-send");
      button.disabled = true;
      send(form)
        .catch((error) => {
          const status = document.getElementById("pg-status");
          status.textContent = error.name === "AbortError" ? "stopped" : error.message;
          status.className = error.name === "AbortError" ? "muted" : "error";
        })
        .finally(() => {
          button.disabled = false;
          stop.disabled = true;
        });
    });
  });
})();
