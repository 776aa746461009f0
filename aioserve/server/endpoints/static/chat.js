// The aioserve chat page. Streams a reply from /v1/chat/completions over
// server-sent events (fetch + ReadableStream), or from /v1/completions for a
// model without a chat template (GET /page-config says which, up front). Model text reaches the page only as Text
// nodes (append of a string, appendData, textContent): never as markup. For a
// model that takes images, the user's own images (attached or dropped) go
// with the next prompt as data URLs in image_url parts.
"use strict";

const KEY_STORAGE = "aioserve.apiKey"; // sessionStorage: forgotten when the tab closes
const DEFAULT_MAX_TOKENS = 256;
const DEFAULT_TEMPERATURE = 0.7;

const $ = (id) => document.getElementById(id);

const state = {
  model: null,        // the served model's id (GET /v1/models); null: let the server pick its one
  mode: "chat",       // "completion" when the server says the model has no chat template
  history: [],        // chat mode: the conversation so far, as OpenAI messages
  controller: null,   // the AbortController of the request under way
  takesImages: false, // the model reads images (GET /page-config)
  images: [],         // data URLs of the images attached to the next prompt
};

// ---- talking to the server -------------------------------------------------

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

// The server's OpenAI-style error ({"error": {"message", "param", ...}}), or
// whatever text came back.
async function readError(response) {
  const text = await response.text();
  try {
    const error = JSON.parse(text).error;
    if (error && typeof error.message === "string") return error;
  } catch (_) { /* not JSON: use the text */ }
  return { message: text || `${response.status} ${response.statusText}` };
}

// The server refuses chat for a model whose tokenizer has no chat template;
// such a model is still useful as a plain-text completer.
function isMissingTemplate(error) {
  return error.param === "messages" && /no chat template/i.test(error.message);
}

function numberFrom(input, fallback, parse) {
  const value = parse(input.value);
  return Number.isFinite(value) && value >= 0 ? value : fallback;
}

// The user turn's content: the text, or with images attached a list of
// image_url parts and the text part (OpenAI's chat form).
function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

function requestFor(mode, text, images = []) {
  const body = {
    model: state.model ?? undefined,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Math.max(1, numberFrom($("max-tokens"), DEFAULT_MAX_TOKENS, (v) => parseInt(v, 10))),
    temperature: numberFrom($("temperature"), DEFAULT_TEMPERATURE, parseFloat),
  };
  if (mode === "chat") {
    const messages = [...state.history, { role: "user", content: userContent(text, images) }];
    return ["/v1/chat/completions", { ...body, messages }];
  }
  return ["/v1/completions", { ...body, prompt: text }];
}

function post(mode, text, signal, images = []) {
  const [path, body] = requestFor(mode, text, images);
  return fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
}

// The JSON payloads of a server-sent-event stream, up to [DONE].
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      wantKey(true);
      $("model").textContent = "this server wants an API key";
      return;
    }
    if (!response.ok) throw new Error((await readError(response)).message);
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
    wantKey(false);
    await loadMode();
  } catch (err) {
    $("model").textContent = `server unreachable: ${err.message}`;
  }
}

// Chat or plain completion, as the model allows: asked before the first
// prompt, so that a model without a chat template never gets a chat request.
async function loadMode() {
  const response = await fetch("/page-config", { headers: headers() });
  if (!response.ok) return; // an older server: the 400 fallback in send() decides
  const config = await response.json();
  setMode(config.chat_template ? "chat" : "completion");
  state.takesImages = Boolean(config.images) && config.chat_template;
  $("attach").hidden = !state.takesImages;
}

// ---- images --------------------------------------------------------------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  if (!state.takesImages) return;
  for (const file of files) {
    if (file.type.startsWith("image/")) state.images.push(await readAsDataURL(file));
  }
  showAttachments();
}

function thumbnail(url, title) {
  const img = document.createElement("img");
  img.src = url; // the user's own file, as a data URL: nothing the model wrote
  img.alt = title;
  return img;
}

// The images waiting for the next prompt; clicking one drops it.
function showAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.images.map((url, i) => {
    const img = thumbnail(url, `image ${i + 1} (click to remove)`);
    img.addEventListener("click", () => {
      state.images.splice(i, 1);
      showAttachments();
    });
    return img;
  }));
  box.hidden = state.images.length === 0;
}

// ---- the page ----------------------------------------------------------------

// Time to first token and decode speed of one reply. Counts content chunks
// while streaming (one per token, but for a partial character held back); the
// server's usage count replaces that at the end.
class Stats {
  constructor() {
    this.start = performance.now();
    this.first = null;
    this.last = null;
    this.chunks = 0;
    this.usageTokens = null;
    this.ended = false;
  }

  end() {
    this.ended = true;
  }

  token() {
    const now = performance.now();
    this.first ??= now;
    this.last = now;
    this.chunks += 1;
  }

  toString() {
    if (this.first === null) return this.ended ? "no tokens" : "waiting for the first token…";
    const tokens = this.usageTokens ?? this.chunks;
    const seconds = (this.last - this.first) / 1000;
    // The first token's time is the prefill's: the rate is of the ones after it.
    const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–";
    const ttft = Math.round(this.first - this.start);
    return `${tokens} ${tokens === 1 ? "token" : "tokens"} · ${rate} tokens/s · time to first token ${ttft} ms`;
  }
}

function addTurn(kind, text) {
  const transcript = $("transcript");
  const turn = document.createElement("div");
  turn.className = `turn ${kind}`;
  if (text) turn.append(text); // a string becomes a Text node: never parsed as HTML
  transcript.append(turn);
  transcript.scrollTop = transcript.scrollHeight;
  return turn;
}

function addNote(turn, text, isError = false) {
  const note = document.createElement("span");
  note.className = isError ? "note error" : "note";
  note.textContent = text;
  turn.append(note);
}

function setMode(mode) {
  state.mode = mode;
  const badge = $("mode");
  badge.hidden = mode === "chat";
  badge.textContent = "completion mode: this model has no chat template, so each prompt is continued as plain text";
}

function wantKey(wanted) {
  $("key-label").classList.toggle("wanted", wanted);
  if (wanted) $("api-key").focus();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

const FINISH_NOTES = {
  stop: "",
  length: "stopped at the max tokens limit",
  abort: "aborted by the server",
};

async function send(text) {
  const images = state.mode === "chat" ? state.images.splice(0) : [];
  showAttachments();
  const userTurn = addTurn("user");
  userTurn.append(...images.map((url, i) => thumbnail(url, `image ${i + 1}`)), text);
  const turn = addTurn("reply streaming");
  // A completion continues the prompt ("Once upon a time" -> ", there was"):
  // the reply shows the prompt before it, so it reads as the whole text.
  const echo = document.createElement("span");
  echo.className = "echo";
  turn.append(echo);
  if (state.mode === "completion") echo.append(text);
  const output = document.createTextNode("");
  const textSpan = document.createElement("span");
  textSpan.className = "text";
  textSpan.append(output);
  turn.append(textSpan);

  const stats = new Stats();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  $("stats").textContent = stats.toString();
  const mode = state.mode;
  let replyMode = mode;
  let finish = null;
  try {
    let response = await post(mode, text, controller.signal, images);
    if (mode === "chat" && response.status === 400) {
      const error = await readError(response);
      if (!isMissingTemplate(error)) throw new Error(error.message);
      setMode("completion");
      replyMode = "completion";
      echo.append(text);
      response = await post(replyMode, text, controller.signal);
    }
    if (!response.ok) {
      if (response.status === 401) wantKey(true);
      throw new Error((await readError(response)).message);
    }
    for await (const chunk of sseData(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) stats.usageTokens = chunk.usage.completion_tokens;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const piece = replyMode === "chat" ? choice.delta?.content : choice.text;
      if (piece) {
        output.appendData(piece);
        stats.token();
        $("stats").textContent = stats.toString();
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (FINISH_NOTES[finish]) addNote(turn, FINISH_NOTES[finish]);
  } catch (err) {
    if (err.name === "AbortError") addNote(turn, "stopped");
    else addNote(turn, err.message, true);
  } finally {
    turn.classList.remove("streaming");
    state.controller = null;
    setBusy(false);
    stats.end();
    $("stats").textContent = stats.toString();
    // turn.isConnected: "New chat" during the reply has already dropped it.
    if (replyMode === "chat" && output.data && turn.isConnected) {
      state.history.push({ role: "user", content: userContent(text, images) }, { role: "assistant", content: output.data });
    }
  }
}

function init() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) ?? "";
  key.addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, key.value.trim());
    loadModel();
  });

  const prompt = $("prompt");
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text || state.controller) return;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("attach").addEventListener("click", () => $("image-file").click());
  $("image-file").addEventListener("change", async (event) => {
    await attach(event.target.files);
    event.target.value = ""; // the same file may be picked again
  });
  const composer = $("composer");
  composer.addEventListener("dragover", (event) => {
    if (!state.takesImages) return;
    event.preventDefault();
    composer.classList.add("dropping");
  });
  composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
  composer.addEventListener("drop", (event) => {
    composer.classList.remove("dropping");
    if (!state.takesImages) return;
    event.preventDefault();
    attach(event.dataTransfer.files);
  });
  // Aborting the fetch closes the connection; the server aborts the request at once.
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", () => {
    state.controller?.abort();
    state.history = [];
    state.images = [];
    showAttachments();
    $("transcript").replaceChildren();
    $("stats").textContent = "—";
  });
  loadModel();
}

init();
