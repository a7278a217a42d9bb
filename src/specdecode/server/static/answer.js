// One answer as it streams: its tokens (the server's per-token `sources` entries, merged where two chunks share a
// token), drawn as text and fenced code blocks in which every token is a <span data-source> with its step in the
// tooltip; and the chart of tokens gained per step.

const LABELS = {
  target: "the target's own token", draft: "draft model", prediction: "prediction", context: "copy of the prompt",
  history: "copy of an earlier answer", lookup: "copy of earlier text", datastore: "datastore", unknown: "unknown",
};
export const SOURCES = ["target", "prediction", "context", "history", "lookup", "datastore", "draft"];

export class Answer {
  constructor(container) {
    this.el = container;
    this.tokens = [];  // {token, text, source, step, drafted, accepted}
    this.text = "";
    this.queued = false;
  }

  // A chunk's entries (their texts add up to the chunk's text).
  add(entries) {
    for (const e of entries) {
      const last = this.tokens[this.tokens.length - 1];
      if (last && last.token !== null && last.token === e.token) last.text += e.text;
      else this.tokens.push({ ...e });
      this.text += e.text;
    }
    this.schedule();
  }

  // Text that came without entries (a server without the extension): shown, uncoloured.
  addText(text) {
    this.add([{ token: null, text, source: "unknown", step: 0, drafted: 0, accepted: 0 }]);
  }

  schedule() {
    if (this.queued) return;
    this.queued = true;
    requestAnimationFrame(() => this.render());
  }

  // Drawn whole (once a frame at most): a code fence can turn earlier text into a code block.
  render() {
    this.queued = false;
    const segments = split(this.text);
    const boxes = segments.map(boxFor);
    let pos = 0;
    let i = 0;
    for (const t of this.tokens) {
      const end = pos + t.text.length;
      while (i < segments.length - 1 && segments[i].end <= pos) i++;
      if (pos === end) boxes[i].inner.append(span(t, "", segments[i].kind === "fence"));
      for (let at = pos; at < end;) {  // a token across a segment boundary: a span each side (the same data-token)
        while (segments[i].end <= at) i++;
        const cut = Math.min(end, segments[i].end);
        boxes[i].inner.append(span(t, this.text.slice(at, cut), segments[i].kind === "fence"));
        at = cut;
      }
      pos = end;
    }
    const merged = [];
    for (const box of boxes) if (!merged.includes(box.outer)) merged.push(box.outer);
    this.el.replaceChildren(...merged);
  }
}

function span(t, text, hidden = false) {
  const el = document.createElement("span");
  el.className = hidden ? "tok fence" : "tok";
  el.dataset.source = t.source;
  if (t.token !== null) {
    el.dataset.token = String(t.token);
    el.dataset.step = String(t.step);
    const guesses = t.drafted === 1 ? "1 guess" : `${t.drafted} guesses`;
    el.title = `${LABELS[t.source] ?? t.source} · token ${t.token + 1} · step ${t.step}: `
      + `its pass verified ${guesses}, ${t.accepted} accepted`;
  }
  el.textContent = text;
  return el;
}

// The answer's text as prose, code and fence segments covering it end to end ("```lang" up to a closing "```").
function split(text) {
  const segments = [];
  const open = /^ {0,3}```([^\n`]*)\n/gm;
  let pos = 0;
  let m;
  while ((m = open.exec(text))) {
    if (m.index > pos) segments.push({ kind: "prose", end: m.index });
    const block = { lang: m[1].trim() };
    const codeStart = m.index + m[0].length;
    segments.push({ kind: "fence", end: codeStart, block });
    const close = /^ {0,3}```[ \t]*(?:\n|$)/gm;
    close.lastIndex = codeStart;
    const c = close.exec(text);
    const codeEnd = c ? c.index : text.length;
    segments.push({ kind: "code", end: codeEnd, block });
    if (!c) { pos = text.length; break; }
    segments.push({ kind: "fence", end: c.index + c[0].length, block });
    pos = c.index + c[0].length;
    open.lastIndex = pos;
  }
  if (pos < text.length || segments.length === 0) segments.push({ kind: "prose", end: text.length });
  return segments;
}

// The element each segment's spans go in: prose in a text box, a block's fences and code in one figure.
function boxFor(segment) {
  if (segment.kind === "prose") {
    const div = document.createElement("div");
    div.className = "prose";
    return { outer: div, inner: div };
  }
  const block = segment.block;
  if (!block.figure) {
    const figure = document.createElement("figure");
    figure.className = "code";
    const caption = document.createElement("figcaption");
    const lang = document.createElement("span");
    lang.textContent = block.lang || "code";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.addEventListener("click", () => copyText(block.code.textContent, copy));
    caption.append(lang, copy);
    const head = document.createElement("span");
    const pre = document.createElement("pre");
    block.code = document.createElement("code");
    pre.append(block.code);
    const tail = document.createElement("span");
    figure.append(caption, head, pre, tail);
    Object.assign(block, { figure, head, tail, seen: 0 });
  }
  const inner = segment.kind === "code" ? block.code : block.seen++ === 0 ? block.head : block.tail;
  return { outer: block.figure, inner };
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) {  // no clipboard API (a page served over plain http to another machine): select and copy
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// Tokens emitted by each step, stacked by source, as SVG bars.
export function drawChart(svg, tokens) {
  const steps = new Map();
  const seen = new Set();
  for (const t of tokens) {
    if (t.token === null || seen.has(t.token)) continue;
    seen.add(t.token);
    if (!steps.has(t.step)) steps.set(t.step, []);
    steps.get(t.step).push(t.source);
  }
  const ns = "http://www.w3.org/2000/svg";
  const bars = [];
  const last = Math.max(0, ...steps.keys());
  const tallest = Math.max(1, ...[...steps.values()].map((s) => s.length));
  const width = 300 / Math.max(last, 1);
  for (const [step, sources] of steps) {
    sources.sort((a, b) => SOURCES.indexOf(a) - SOURCES.indexOf(b));
    sources.forEach((source, i) => {
      const rect = document.createElementNS(ns, "rect");
      rect.setAttribute("x", String((step - 1) * width));
      rect.setAttribute("width", String(Math.max(width * 0.85, 0.5)));
      rect.setAttribute("y", String(100 - (i + 1) * (100 / tallest)));
      rect.setAttribute("height", String(100 / tallest));
      rect.dataset.source = source;
      bars.push(rect);
    });
  }
  svg.replaceChildren(...bars);
  svg.dataset.steps = String(steps.size);
}
