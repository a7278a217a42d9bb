// The page's client of the server's OpenAI-compatible API: URLs relative to the page (it may live under a path
// prefix), the API key from this tab's session storage, and every failure as an ApiError with a sentence a person
// can read.

const KEY = "specdecode-api-key";

export class ApiError extends Error {
  constructor(message, { status = 0, code = null, needsKey = false } = {}) {
    super(message);
    this.status = status;
    this.code = code;
    this.needsKey = needsKey;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY);
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

function url(path) {
  return new URL(path, document.baseURI).href;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function send(path, init) {
  let response;
  try {
    response = await fetch(url(path), { ...init, headers: headers() });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError("Could not reach the server. Is `specdecode serve` still running?");
  }
  if (!response.ok) throw await refusal(response);
  return response;
}

async function refusal(response) {
  let message = response.statusText || "no details";
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch (e) { /* not JSON: the status line says it */ }
  const status = response.status;
  if (status === 401) {
    const had = apiKey() !== null;
    return new ApiError(had ? "The server refused this API key. Enter the right one."
                            : "This server needs an API key.", { status, code, needsKey: true });
  }
  const who = status >= 500 ? "The server failed" : "The server refused the request";
  return new ApiError(`${who} (${status}${code ? `, ${code}` : ""}): ${message}`, { status, code });
}

export async function models() {
  const response = await send("v1/models", { method: "GET" });
  return (await response.json()).data;
}

// Streams a chat completion: yields each parsed chunk. Ends normally only at `data: [DONE]`; a stream that stops
// before it, or an error event inside it, is an ApiError.
export async function* chatStream(body, signal) {
  const response = await send("v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let read;
    try {
      read = await reader.read();
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError("The connection dropped before the answer ended; what arrived is kept.");
    }
    if (read.done) break;
    buffer += decoder.decode(read.value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;  // ": keep-alive" comments
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new ApiError(`The generation failed (${chunk.error.code ?? chunk.error.type}): ${chunk.error.message}`,
                             { code: chunk.error.code });
        }
        yield chunk;
      }
    }
  }
  throw new ApiError("The connection dropped before the answer ended; what arrived is kept.");
}
