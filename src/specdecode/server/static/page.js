// The page: a chat that talks to /v1/chat/completions like any client, asking for each token's source
// (stream_options.include_sources), and optionally the same request again with plain decoding beside it.
// body[data-state] is "loading", "idle" or "streaming" (styles and tests read it).

import { ApiError, apiKey, chatStream, models, setApiKey } from "./api.js";
import { Answer, SOURCES, drawChart } from "./answer.js";

const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null, stopped: false };

function setState(name) {
  document.body.dataset.state = name;
  const busy = name === "streaming";
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("clear").disabled = busy;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// -- the server and its key ---------------------------------------------------------------------------------------------
async function connect() {
  try {
    const data = await models();
    state.model = data[0]?.id ?? null;
    $("model").textContent = state.model ?? "";
    clearError();
    return true;
  } catch (e) {
    fail(e);
    return false;
  }
}

function fail(e) {
  showError(e instanceof ApiError ? e.message : `Something went wrong in the page: ${e.message}`);
  if (e.needsKey) askKey(apiKey() !== null ? e.message : "");
}

function askKey(problem) {
  $("key-error").textContent = problem;
  $("key-error").hidden = !problem;
  $("key").value = "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// -- settings ------------------------------------------------------------------------------------------------------------
function settings() {
  const temperature = Number($("temperature").value);
  if ($("temperature").value === "" || !(temperature >= 0 && temperature <= 2)) {
    throw new ApiError("Temperature must be a number from 0 (greedy) to 2.");
  }
  const maxTokens = Number($("max-tokens").value);
  if (!Number.isInteger(maxTokens) || maxTokens < 1) throw new ApiError("Max tokens must be a whole number, 1 or more.");
  return { temperature, maxTokens, method: $("method").value, exact: $("exact").checked, compare: $("compare").checked };
}

function prediction(message) {
  if ($("use-last-code").checked) {
    const blocks = [...message.matchAll(/```[^\n]*\n([\s\S]*?)```/g)];
    if (blocks.length) return blocks[blocks.length - 1][1];
  }
  return $("prediction").value || null;
}

// -- one request -------------------------------------------------------------------------------------------------------
// Streams `messages` into `answer`; returns the run's numbers, or null if it failed or was stopped.
async function run(messages, opts, method, predicted, answer, numbers) {
  const speculation = { method };
  if (opts.exact) speculation.exact = true;
  const body = { model: state.model, messages, stream: true, temperature: opts.temperature,
                 max_tokens: opts.maxTokens, speculation, stream_options: { include_sources: true } };
  if (predicted) body.prediction = { type: "content", content: predicted };
  const controller = new AbortController();
  state.controller = controller;
  const t0 = performance.now();
  const out = { ttft: null, seconds: null, usage: null, speculation: null };
  numbers.textContent = "waiting for the first token…";
  try {
    for await (const chunk of chatStream(body, controller.signal)) {
      const choice = chunk.choices?.[0];
      if (choice?.sources) answer.add(choice.sources);
      else if (choice?.delta?.content) answer.addText(choice.delta.content);
      if (out.ttft === null && answer.text) out.ttft = (performance.now() - t0) / 1000;
      if (chunk.usage) out.usage = chunk.usage;
      if (chunk.speculation) out.speculation = chunk.speculation;
      if (out.ttft !== null) numbers.textContent = `${answer.tokens.length} tokens…`;
    }
    out.seconds = (performance.now() - t0) / 1000;
    numbers.textContent = summary(out);
    return out;
  } catch (e) {
    if (e.name === "AbortError") {
      numbers.textContent = "stopped";
      return null;
    }
    numbers.textContent = "failed";
    fail(e);
    return null;
  } finally {
    state.controller = null;
    answer.render();
  }
}

function summary(out) {
  const speed = out.speculation?.decode_tokens_per_second;
  const tokens = out.usage?.completion_tokens ?? 0;
  return `${tokens} tokens in ${out.seconds.toFixed(2)} s` + (speed ? ` · decoding ${speed.toFixed(1)} tok/s` : "");
}

// -- the conversation ------------------------------------------------------------------------------------------------
function bubble(role, text) {
  const welcome = document.querySelector("#conversation .welcome");
  if (welcome) welcome.remove();
  const el = document.createElement("div");
  el.className = `message ${role}`;
  if (text !== undefined) {
    el.textContent = text;
  }
  $("conversation").append(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

async function send() {
  if (document.body.dataset.state === "streaming") return;
  const text = $("message").value;
  if (!text.trim()) return;
  clearError();
  let opts;
  try {
    opts = settings();
  } catch (e) {
    fail(e);
    return;
  }
  if (!state.model && !(await connect())) return;
  const messages = [...state.history, { role: "user", content: text }];
  const predicted = prediction(text);
  setState("streaming");
  state.stopped = false;
  $("message").value = "";
  bubble("user", text);
  const answerEl = bubble("assistant");
  answerEl.classList.add("answer-box");
  const answer = new Answer(answerEl);
  $("spec-method").textContent = opts.method;
  $("compare-verdict").hidden = true;
  const spec = await run(messages, opts, opts.method, predicted, answer, $("spec-numbers"));
  if (spec === null && !answer.text) {  // nothing came: the message goes back to the box, the turn away
    answerEl.previousElementSibling.remove();
    answerEl.remove();
    if (!$("message").value) $("message").value = text;
  } else {
    state.history = [...messages, { role: "assistant", content: answer.text }];
  }
  if (spec !== null) showNumbers(spec, answer);
  if (spec !== null && opts.compare && !state.stopped) await compare(messages, opts, answer, spec);
  setState("idle");
  $("message").focus();
}

// The same request with plain decoding, after the speculative one (one after the other: each has the machine to
// itself, as a client alone would).
async function compare(messages, opts, answer, spec) {
  $("plain-column").hidden = false;
  const plain = new Answer($("plain-answer"));
  plain.render();
  const out = await run(messages, opts, "autoregressive", null, plain, $("plain-numbers"));
  if (out === null) return;
  const same = plain.text === answer.text;
  const verdict = $("compare-verdict");
  verdict.dataset.identical = String(same);
  const speedup = out.seconds / spec.seconds;
  const greedy = opts.temperature === 0;
  verdict.textContent = (same ? "The two answers are identical." : greedy
    ? "The two answers differ (greedy answers part only where the target's two best tokens nearly tie; exact mode rules that out)."
    : "The two answers differ, as two samples do.")
    + ` Speculative ${spec.seconds.toFixed(2)} s, plain ${out.seconds.toFixed(2)} s: a speed-up of ${speedup.toFixed(2)}×.`;
  verdict.hidden = false;
}

function showNumbers(out, answer) {
  const spec = out.speculation ?? {};
  $("n-ttft").textContent = out.ttft === null ? "–" : `${(out.ttft * 1000).toFixed(0)} ms`;
  const speed = spec.decode_tokens_per_second;
  $("n-speed").textContent = speed ? `${speed.toFixed(1)} tok/s` : "–";
  $("n-per-pass").textContent = spec.mean_accepted_tokens ? spec.mean_accepted_tokens.toFixed(2) : "–";
  const accepted = {};
  const seen = new Set();
  for (const t of answer.tokens) {
    if (t.token === null || seen.has(t.token) || t.source === "target") continue;
    seen.add(t.token);
    accepted[t.source] = (accepted[t.source] ?? 0) + 1;
  }
  const drafted = spec.sources ?? {};
  const parts = SOURCES.filter((s) => accepted[s] || drafted[s]?.drafted).map((s) => {
    const d = drafted[s]?.drafted;
    return d ? `${s} ${accepted[s] ?? 0} of ${d}` : `${s} ${accepted[s]}`;
  });
  $("n-sources").textContent = parts.length ? parts.join(", ") : "none (every token the target's own)";
  const details = out.usage?.completion_tokens_details;
  $("n-prediction").textContent = details
    ? `${details.accepted_prediction_tokens} / ${details.rejected_prediction_tokens}` : "–";
  drawChart($("chart"), answer.tokens);
}

function clear() {
  state.history = [];
  $("conversation").replaceChildren();
  $("plain-answer").replaceChildren();
  $("plain-column").hidden = true;
  $("compare-verdict").hidden = true;
  for (const id of ["spec-numbers", "plain-numbers"]) $(id).textContent = "";
  for (const id of ["n-ttft", "n-speed", "n-per-pass", "n-sources", "n-prediction"]) $(id).textContent = "–";
  $("chart").replaceChildren();
  clearError();
}

// -- wiring --------------------------------------------------------------------------------------------------------------
$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  send();
});
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
$("stop").addEventListener("click", () => {
  state.stopped = true;
  state.controller?.abort();
});
$("clear").addEventListener("click", clear);
$("colours").addEventListener("change", () => document.body.classList.toggle("no-colours", !$("colours").checked));
$("compare").addEventListener("change", () => {
  document.querySelector("#spec-column .column-title").hidden = !$("compare").checked;
  if (!$("compare").checked) $("plain-column").hidden = true;
});
$("key-form").addEventListener("submit", async () => {
  setApiKey($("key").value.trim());
  await connect();
});

setState("loading");
connect().finally(() => setState("idle"));
