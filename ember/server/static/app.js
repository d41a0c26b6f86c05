// ember's chat page: one file, no build step, no dependencies.
//
// Model output is untrusted. Nothing the model (or a user) writes is ever parsed as
// HTML: the markdown renderer below builds DOM nodes and fills them with textContent,
// links are kept only for http(s) URLs, and the server sends a Content-Security-Policy
// that allows this file's scripts only.
"use strict";

const STORE = "ember.chat.v1";
const DEFAULTS = {
  apiKey: "", model: "", system: "", temperature: 0.7, topP: 1, maxTokens: 512,
  seed: "", format: "free", schema: "",
};

const $ = (id) => document.getElementById(id);
const state = { convs: [], current: null, settings: { ...DEFAULTS }, run: null, blockedUntil: 0 };

// ------------------------------------------------------------------ storage
function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    const valid = (c) => c && typeof c.id === "string" && Array.isArray(c.messages);
    state.convs = Array.isArray(saved.convs) ? saved.convs.filter(valid) : [];
    state.current = saved.current || null;
    state.settings = { ...DEFAULTS, ...(saved.settings || {}) };
  } catch {  // whatever is stored is unreadable: start afresh rather than not at all
    state.convs = [];
  }
  if (!state.convs.some((c) => c.id === state.current)) state.current = null;
  for (const conv of state.convs) {  // a reply cut short by closing the page
    for (const m of conv.messages) if (m?.state === "streaming") m.state = "stopped";
  }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(
    { convs: state.convs, current: state.current, settings: state.settings }));
}

function conversation() {
  let conv = state.convs.find((c) => c.id === state.current);
  if (!conv) {
    conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
             title: "New chat", messages: [] };
    state.convs.unshift(conv);
    state.current = conv.id;
  }
  return conv;
}

// ------------------------------------------------------------------ safe markdown
function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\([^)\s]+\))/g;

function inline(parent, text) {
  let at = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > at) parent.append(text.slice(at, m.index));
    const t = m[0];
    if (m[1]) parent.append(el("code", {}, t.slice(1, -1)));
    else if (m[2]) parent.append(el("strong", {}, t.slice(2, -2)));
    else if (m[3]) parent.append(el("em", {}, t.slice(1, -1)));
    else {
      const [, label, href] = t.match(/^\[([^\]]+)\]\(([^)]+)\)$/);
      let url = null;
      try { url = new URL(href); } catch { /* not a URL: shown as text */ }
      if (url && (url.protocol === "http:" || url.protocol === "https:")) {
        const a = el("a", { href: url.href, rel: "noopener noreferrer nofollow", target: "_blank" },
                     label);
        parent.append(a);
      } else {
        parent.append(t);
      }
    }
    at = m.index + t.length;
  }
  if (at < text.length) parent.append(text.slice(at));
}

function codeBlock(lang, code) {
  const wrap = el("div", { class: "code" });
  const copy = el("button", { type: "button", class: "copy", "aria-label": "Copy code" }, "Copy");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  const pre = el("pre");
  pre.append(el("code", lang ? { "data-lang": lang } : {}, code));
  wrap.append(copy, pre);
  return wrap;
}

function markdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) {
      const p = el("p");
      para.forEach((line, i) => {
        if (i) p.append(el("br"));
        inline(p, line);
      });
      out.append(p);
      para = [];
    }
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      out.append(codeBlock(fence[1], code.join("\n")));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    const quote = line.match(/^>\s?(.*)$/);
    if (heading) {
      flush();
      const h = el(`h${Math.min(6, heading[1].length + 2)}`);
      inline(h, heading[2]);
      out.append(h);
    } else if (bullet || numbered) {
      if (para.length) flush();
      const tag = bullet ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = el(tag);
        out.append(list);
      }
      const li = el("li");
      inline(li, (bullet || numbered)[1]);
      list.append(li);
    } else if (quote) {
      flush();
      const q = el("blockquote");
      inline(q, quote[1]);
      out.append(q);
    } else if (!line.trim()) {
      flush();
    } else {
      list = null;
      para.push(line);
    }
  }
  flush();
  return out;
}

// ------------------------------------------------------------------ rendering
function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const conv of state.convs) {
    const li = el("li", conv.id === state.current ? { "aria-current": "true" } : {});
    const open = el("button", { type: "button", class: "open" }, conv.title);
    open.addEventListener("click", () => { if (!state.run) select(conv.id); });
    const rename = el("button", { type: "button", "aria-label": `Rename ${conv.title}` }, "✎");
    rename.addEventListener("click", () => startRename(li, conv));
    const del = el("button", { type: "button", "aria-label": `Delete ${conv.title}` }, "✕");
    del.addEventListener("click", () => remove(conv.id));
    li.append(open, rename, del);
    ul.append(li);
  }
}

function startRename(li, conv) {
  const input = el("input", { type: "text", "aria-label": "Conversation title" });
  input.value = conv.title;
  li.replaceChildren(input);
  input.focus();
  input.select();
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      conv.title = input.value.trim() || conv.title;
      save();
      renderList();
    } else if (e.key === "Escape") {
      renderList();
    }
  });
  input.addEventListener("blur", () => renderList());
}

function remove(id) {
  if (state.run && state.current === id) stop();
  state.convs = state.convs.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.convs[0]?.id || null;
  save();
  renderAll();
}

function select(id) {
  state.current = id;
  save();
  renderAll();
}

function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.tokens != null) parts.push(`${stats.tokens} tokens`);
  if (stats.cached != null) parts.push(`${stats.cached} cached prompt tokens`);
  if (stats.ttft != null) parts.push(`TTFT ${(stats.ttft * 1000).toFixed(0)} ms`);
  if (stats.rate != null) parts.push(`${stats.rate.toFixed(1)} tokens/s`);
  if (stats.specDrafted) {
    parts.push(`speculation ${stats.specAccepted}/${stats.specDrafted} accepted`);
  }
  if (stats.finish) parts.push(stats.finish);
  return parts.join(" · ");
}

function renderMessage(msg, index) {
  const mine = msg.role === "user";
  const art = el("article", { class: `msg ${msg.role}`, "aria-label": mine ? "You" : "Assistant",
                              "data-state": msg.state || "done" });
  if (msg.reasoning) {
    const details = el("details", { class: "reasoning" });
    details.append(el("summary", {}, "Reasoning"));
    const body = el("div");
    body.append(markdown(msg.reasoning));
    details.append(body);
    art.append(details);
  }
  const body = el("div", { class: "body" });
  if (mine) body.textContent = msg.content;
  else body.append(markdown(msg.content || ""));
  art.append(body);
  for (const call of msg.toolCalls || []) {
    const details = el("details", { class: "tool-call", open: "" });
    details.append(el("summary", {}, `Tool call: ${call.function?.name || "?"}`));
    details.append(el("pre", {}, call.function?.arguments || ""));
    art.append(details);
  }
  if (msg.error) art.append(el("p", { class: "error" }, msg.error));
  if (!mine && msg.stats) art.append(el("p", { class: "stats" }, statsLine(msg.stats)));
  if (mine) {
    const edit = el("button", { type: "button", class: "edit", "aria-label": "Edit message" },
                    "Edit");
    edit.addEventListener("click", () => startEdit(art, index));
    art.append(edit);
  }
  return art;
}

function startEdit(art, index) {
  if (state.run) return;
  const conv = conversation();
  const area = el("textarea", { "aria-label": "Edited message", rows: "3" });
  area.value = conv.messages[index].content;
  const resend = el("button", { type: "button" }, "Save and send");
  const cancel = el("button", { type: "button" }, "Cancel");
  resend.addEventListener("click", () => {
    const text = area.value.trim();
    if (!text) return;
    conv.messages = conv.messages.slice(0, index);
    conv.messages.push({ role: "user", content: text });
    save();
    renderAll();
    generate();
  });
  cancel.addEventListener("click", () => renderAll());
  art.replaceChildren(area, resend, cancel);
  area.focus();
}

function renderMessages() {
  const box = $("messages");
  const conv = state.convs.find((c) => c.id === state.current);
  box.replaceChildren(...(conv ? conv.messages.map(renderMessage) : []));
  box.scrollTop = box.scrollHeight;
  const last = conv?.messages.at(-1);
  $("regenerate").hidden = !!state.run || !last || last.role !== "assistant";
  $("stop").hidden = !state.run;
  $("send").disabled = !!state.run || Date.now() < state.blockedUntil;
}

function renderAll() {
  renderList();
  renderMessages();
  $("model-name").textContent = state.settings.model || "";
}

// ------------------------------------------------------------------ banner
let bannerTimer = null;

function banner(text, retryAfter = 0) {
  const box = $("banner");
  clearInterval(bannerTimer);
  if (!text) {
    box.hidden = true;
    return;
  }
  box.hidden = false;
  if (!retryAfter) {
    box.textContent = text;
    return;
  }
  state.blockedUntil = Date.now() + retryAfter * 1000;
  const tick = () => {
    const left = Math.ceil((state.blockedUntil - Date.now()) / 1000);
    if (left <= 0) {
      clearInterval(bannerTimer);
      box.textContent = `${text} You may send again.`;
      state.blockedUntil = 0;
      renderMessages();
      return;
    }
    box.textContent = `${text} Retry in ${left} s.`;
  };
  tick();
  bannerTimer = setInterval(tick, 250);
  renderMessages();
}

async function errorOf(res) {
  let message = res.statusText;
  try {
    const body = await res.json();
    message = body?.error?.message || message;
  } catch { /* not JSON */ }
  if (res.status === 401) {
    return [`Unauthorized (401): ${message}. Set the API key in Settings.`, 0];
  }
  if (res.status === 429) {
    const wait = Number(res.headers.get("Retry-After")) || 1;
    return [`Too many requests (429): ${message}.`, wait];
  }
  return [`Error ${res.status}: ${message}`, 0];
}

// ------------------------------------------------------------------ the API
function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.apiKey) h.Authorization = `Bearer ${state.settings.apiKey}`;
  return h;
}

async function loadModels() {
  const select = document.querySelector("#settings-form [name=model]");
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch {
    banner("The server is not reachable.");
    return;
  }
  if (!res.ok) {
    banner(...await errorOf(res));
    return;
  }
  const models = (await res.json()).data || [];
  select.replaceChildren(...models.map((m) => el(
    "option", { value: m.id }, m.parent ? `${m.id} (adapter of ${m.parent})` : m.id)));
  if (!models.some((m) => m.id === state.settings.model)) {
    state.settings.model = models[0]?.id || "";
    save();
  }
  select.value = state.settings.model;
  $("model-name").textContent = state.settings.model;
}

function requestBody(conv) {
  const s = state.settings;
  const messages = [];
  if (s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of conv.messages) {
    if (m.role === "user" || (m.role === "assistant" && m.state !== "error")) {
      messages.push({ role: m.role, content: m.content || "" });
    }
  }
  // an emptied field means its default, never 0
  const number = (key) => Number(s[key] === "" || s[key] == null ? DEFAULTS[key] : s[key]);
  const body = {
    model: s.model, messages, stream: true, stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("topP"), max_tokens: number("maxTokens"),
  };
  if (s.seed !== "" && s.seed != null) body.seed = Number(s.seed);
  if (s.format === "json_schema") {
    body.response_format = { type: "json_schema",
                             json_schema: { name: "reply", schema: JSON.parse(s.schema || "{}") } };
  }
  return body;
}

async function generate() {
  const conv = conversation();
  let body;
  try {
    body = requestBody(conv);
  } catch (e) {
    banner(`The JSON schema is not valid JSON: ${e.message}`);
    return;
  }
  const msg = { role: "assistant", content: "", reasoning: "", toolCalls: [], state: "streaming",
                stats: {} };
  conv.messages.push(msg);
  const controller = new AbortController();
  state.run = { controller, msg };
  banner("");
  renderMessages();
  const started = performance.now();
  let first = null;
  let frame = 0;
  const redraw = () => {
    if (!frame) frame = requestAnimationFrame(() => { frame = 0; renderMessages(); });
  };
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      const [text, wait] = await errorOf(res);
      conv.messages.pop();
      banner(text, wait);
      return;
    }
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      const choice = chunk.choices?.[0];
      const delta = choice?.delta || {};
      if ((delta.content || delta.reasoning_content) && first === null) {
        first = performance.now();
      }
      if (delta.content) msg.content += delta.content;
      if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls || []) {
        const slot = msg.toolCalls[call.index ?? 0] ||= { function: { name: "", arguments: "" } };
        if (call.function?.name) slot.function.name += call.function.name;
        if (call.function?.arguments) slot.function.arguments += call.function.arguments;
      }
      if (choice?.finish_reason) msg.stats.finish = `finished: ${choice.finish_reason}`;
      if (chunk.usage) usage(msg.stats, chunk.usage, started, first);
      redraw();
    });
    msg.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      msg.state = "stopped";
      msg.stats.finish = "stopped";
    } else {
      msg.state = "error";
      msg.error = e instanceof TypeError ? "The server is not reachable." : e.message;
      if (e instanceof TypeError) banner("The server is not reachable.");
    }
  } finally {
    state.run = null;
    if (conv.title === "New chat" && conv.messages[0]) {
      conv.title = conv.messages[0].content.slice(0, 40);
    }
    save();
    renderAll();
  }
}

function usage(stats, u, started, first) {
  const now = performance.now();
  stats.tokens = u.completion_tokens;
  stats.cached = u.prompt_tokens_details?.cached_tokens ?? 0;
  if (first !== null) {
    stats.ttft = (first - started) / 1000;
    const decode = (now - first) / 1000;
    if (u.completion_tokens > 1 && decode > 0) stats.rate = (u.completion_tokens - 1) / decode;
  }
  const d = u.completion_tokens_details;
  if (d && (d.accepted_prediction_tokens || d.rejected_prediction_tokens)) {
    stats.specAccepted = d.accepted_prediction_tokens || 0;
    stats.specDrafted = stats.specAccepted + (d.rejected_prediction_tokens || 0);
  }
}

async function readEvents(res, onChunk) {
  const reader = res.body.getReader();
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
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function stop() {
  if (state.run) state.run.controller.abort();
}

// ------------------------------------------------------------------ settings
function openSettings() {
  const form = $("settings-form");
  for (const [k, v] of Object.entries(state.settings)) {
    if (form.elements[k]) form.elements[k].value = v;
  }
  $("settings").showModal();
  loadModels();
}

function closeSettings() {
  const dialog = $("settings");
  if (dialog.returnValue !== "save") return;
  const form = $("settings-form");
  for (const k of Object.keys(DEFAULTS)) {
    if (form.elements[k]) state.settings[k] = form.elements[k].value;
  }
  save();
  banner("");
  loadModels();
}

// ------------------------------------------------------------------ wiring
function init() {
  load();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.run || Date.now() < state.blockedUntil) return;
    conversation().messages.push({ role: "user", content: text });
    $("message").value = "";
    save();
    renderAll();
    generate();
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", () => {
    const conv = conversation();
    if (state.run || conv.messages.at(-1)?.role !== "assistant") return;
    conv.messages.pop();
    generate();
  });
  $("new-chat").addEventListener("click", () => {
    if (state.run) return;
    state.current = null;
    conversation();
    save();
    renderAll();
    $("message").focus();
  });
  $("open-settings").addEventListener("click", openSettings);
  $("settings").addEventListener("close", closeSettings);
  renderAll();
  loadModels();
}

init();
