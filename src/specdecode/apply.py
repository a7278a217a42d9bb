"""`specdecode apply FILE INSTRUCTION`: a local "fast apply". The file goes into a chat prompt that asks for the whole
updated file in one code block, and the same block, unchanged, is the prediction (Predicted Outputs): the lines the
edit keeps are verified many tokens a pass. The answer's code block is the new file, shown as a unified diff or
written in place. No torch here: the engine loads in commands.load_engine; with --server, apply_client.py asks a
running `specdecode serve`."""
from __future__ import annotations

import difflib
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import SpecDecodeError

LANGUAGES = {".py": "python", ".js": "javascript", ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx", ".rs": "rust",
             ".go": "go", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp", ".java": "java",
             ".kt": "kotlin", ".rb": "ruby", ".php": "php", ".cs": "csharp", ".swift": "swift", ".sh": "bash",
             ".sql": "sql", ".html": "html", ".css": "css", ".md": "markdown", ".json": "json", ".yaml": "yaml",
             ".yml": "yaml", ".toml": "toml", ".xml": "xml"}
BACKUP_SUFFIX = ".orig"
ANSWER_MARGIN = 64  # tokens the answer may take beyond 1.5x the file's: the fence lines and an edit that adds text

# A fence line (CommonMark): up to 3 spaces, then 3 or more backticks (an info string without backticks) or tildes
OPENING = re.compile(r"^( {0,3})(`{3,}(?=[^`]*$)|~{3,})(.*)$")
CLOSING = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*$")


class NoCodeBlock(SpecDecodeError):
    """The model's answer holds no complete code block: nothing to apply (the file is left alone)."""


@dataclass
class Source:
    """The file being edited: its text with "\\n" line ends and no byte-order mark, and how to write it back."""
    path: Path
    text: str
    crlf: bool = False
    bom: bool = False

    def encoded(self, text: str) -> bytes:
        """`text` in the file's own conventions (CRLF line ends, a UTF-8 byte-order mark) where it had them."""
        if self.crlf:
            text = text.replace("\n", "\r\n")
        return ("\ufeff" if self.bom else "").encode() + text.encode("utf-8")


def read_source(path: str | Path) -> Source:
    """The file as a Source; SpecDecodeError (exit status 2) for a file that is missing or not UTF-8 text."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SpecDecodeError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecDecodeError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                              "apply edits text files") from None
    if "\x00" in text:
        raise SpecDecodeError(f"{path} holds NUL bytes: a binary file, not text; apply edits text files")
    bom = text.startswith("\ufeff")
    text = text.removeprefix("\ufeff")
    crlf = "\r\n" in text
    return Source(path, text.replace("\r\n", "\n") if crlf else text, crlf, bom)


def fence_for(text: str) -> str:
    """Backticks enough that no run of backticks in `text` closes the block early (a Markdown file's own fences)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def fenced(text: str, lang: str, fence: str) -> str:
    return f"{fence}{lang}\n{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{fence}"


def build_request(source: Source, instruction: str) -> tuple[list[dict], str]:
    """(chat messages, prediction): the prompt holds the file and the instruction and asks for the whole updated file
    in one code block; the prediction is the file in that block, as the answer starts if nothing changes."""
    fence, lang = fence_for(source.text), LANGUAGES.get(source.path.suffix.lower(), "")
    block = fenced(source.text, lang, fence)
    name = source.path.name
    prompt = (f"Here is the file `{name}`:\n\n{block}\n\nInstruction: {instruction.strip()}\n\n"
              f"Apply the instruction to the file. Reply with the whole updated file in one {fence}{lang} code block: "
              "every line of it, changed or not, and nothing after the block.")
    return [{"role": "user", "content": prompt}], block


def _blocks(answer: str) -> list[tuple[str, bool]]:
    """Each fenced code block of a Markdown answer: (its text, whether its closing fence came)."""
    lines, out, i = answer.splitlines(keepends=True), [], 0
    while i < len(lines):
        m = OPENING.match(lines[i].rstrip("\n"))
        i += 1
        if not m:
            continue
        indent, fence, body = len(m.group(1)), m.group(2), []
        while i < len(lines):
            close = CLOSING.match(lines[i].rstrip("\n"))
            if close and close.group(1)[0] == fence[0] and len(close.group(1)) >= len(fence):
                break
            line = lines[i]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])  # the fence's indent, as CommonMark
            i += 1
        out.append(("".join(body), i < len(lines)))
        i += 1
    return out


def extract_block(answer: str) -> str:
    """The new file: the answer's longest fenced code block, with or without a language tag (prose around it and
    smaller blocks, an example say, are left out). NoCodeBlock where there is none or the longest was cut off."""
    blocks = _blocks(answer.replace("\r\n", "\n"))
    if not blocks:
        raise NoCodeBlock("the model's answer has no fenced code block, so there is nothing to apply")
    text, closed = max(blocks, key=lambda b: len(b[0]))
    if not closed:
        raise NoCodeBlock("the model's answer stopped inside its code block (its closing fence never came), so the "
                          "file would be cut short")
    return text


def match_final_newline(new: str, old: str) -> str:
    """A code block always ends its last line; a file that did not keep it unended."""
    if new.endswith("\n") and old and not old.endswith("\n"):
        return new[:-1]
    return new


def unified_diff(old: str, new: str, name: str) -> str:
    """`diff -u` of two texts as `git diff` writes it: a/ and b/ names, "\\ No newline at end of file" where due."""
    out = []
    for line in difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                     f"a/{name}", f"b/{name}"):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def write_atomically(source: Source, text: str) -> Path:
    """Replace the file with `text` in one rename (a reader sees the old file or the new, never half of one), its
    mode kept; the old file first copied to FILE.orig (replacing an older backup). Returns the backup's path."""
    path = source.path.resolve()  # through a symlink: the file it names is replaced, the link stays
    backup = path.with_name(path.name + BACKUP_SUFFIX)
    shutil.copy2(path, backup)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(source.encoded(text))
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return backup


@dataclass
class Reply:
    """One answer, from the local engine or a server: its text, why it ended, its stats (Stats.as_dict(), as the
    server's `speculation` field holds them) and the prediction's accepted and rejected tokens."""
    text: str
    finish: str | None
    stats: dict
    accepted: int = 0
    rejected: int = 0


def reply_of(answer: dict) -> Reply:
    """A server's chat completion (JSON) as a Reply: the usage's prediction tokens, the `speculation` stats."""
    choice = answer["choices"][0]
    details = (answer.get("usage") or {}).get("completion_tokens_details") or {}
    return Reply(choice["message"].get("content") or "", choice.get("finish_reason"), answer.get("speculation") or {},
                 details.get("accepted_prediction_tokens") or 0, details.get("rejected_prediction_tokens") or 0)


def answer_budget(file_tokens: int, prompt_tokens: int, context: int) -> int:
    """The default max_new_tokens: room for the file once and a half and a margin, within the context."""
    room = context - prompt_tokens
    if room <= 0:
        raise SpecDecodeError(f"the prompt (the file and the instruction) has {prompt_tokens} tokens; the model's "
                              f"context holds {context}, so no answer fits")
    return min(room, file_tokens * 3 // 2 + ANSWER_MARGIN)


def stats_line(reply: Reply, plain: Reply | None, where: str, greedy: bool = True) -> str:
    """One line: tokens, seconds, decode speed, the prediction's tokens, and plain decoding's speed beside it (measured
    with --compare, else the cost model's seconds of a plain step where the method planned with it)."""
    s = reply.stats
    rate = s.get("decode_tokens_per_second")
    parts = [f"apply: {s.get('new_tokens', 0)} tokens in {s.get('wall_s', 0.0):.2f}s "
             f"(first after {s.get('ttft_s') or 0.0:.2f}s), decode {_rate(rate)}",
             f"prediction: {reply.accepted} tokens accepted, {reply.rejected} rejected"]
    if plain is not None:
        base = plain.stats.get("decode_tokens_per_second")
        same = "" if not greedy else ", same answer" if plain.text == reply.text else ", its answer differs (a near-tie)"
        parts.append(f"plain decoding {_rate(base)} (measured{same}): {_ratio(rate, base)}")
    elif s.get("plain_step_s"):
        base = 1.0 / s["plain_step_s"]
        parts.append(f"plain decoding ~{base:.2f} tok/s (the cost model's): ~{_ratio(rate, base)}")
    else:
        parts.append("plain decoding: --compare measures it")
    return " | ".join(parts + [where])


def _rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.2f} tok/s"


def _ratio(rate: float | None, base: float | None) -> str:
    return "n/a" if not rate or not base else f"{rate / base:.2f}x"


def run_local(args, messages: list[dict], prediction: str) -> tuple[Reply, Reply | None, str]:
    """The answer (and plain decoding's, with --compare) from an engine loaded here, and where it ran."""
    from .commands import load_engine, tree_kwargs
    engine = load_engine(args, [args.method])
    budget = args.max_new_tokens
    if budget is None:
        budget = answer_budget(len(engine.encode_prediction(prediction) or ()), len(engine.encode(messages)),
                               engine.target.max_length)
    sampling = dict(max_new_tokens=budget, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed)
    out = engine.generate(messages, method=args.method, gamma=args.gamma, prediction=prediction,
                          **tree_kwargs(args), **sampling)
    src = out.stats.sources.get("prediction", {"drafted": 0, "accepted": 0})
    reply = Reply(out.text, out.stats.finish_reason, out.stats.as_dict(), src["accepted"],
                  src["drafted"] - src["accepted"])
    plain = None
    if args.compare:
        p = engine.generate(messages, method="autoregressive", **sampling)
        plain = Reply(p.text, p.stats.finish_reason, p.stats.as_dict())
    return reply, plain, f"backend {out.stats.engine or engine.backend}"


def apply_command(args) -> int:
    """Exit status 0: the diff printed (nothing where the answer changes nothing) or the file written; 1: the answer
    held no usable code block (the file is left alone); 2 (SpecDecodeError): bad input."""
    from .checks import check_request
    from .commands import tree_kwargs
    instruction = sys.stdin.read() if args.instruction == "-" else args.instruction
    if not instruction.strip():
        raise SpecDecodeError("the instruction is empty")
    source = read_source(args.file)
    check_request(method=args.method, gamma=args.gamma,
                  max_new_tokens=1 if args.max_new_tokens is None else args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **tree_kwargs(args))
    messages, prediction = build_request(source, instruction)
    if args.server is None:
        reply, plain, where = run_local(args, messages, prediction)
    else:
        from .apply_client import ask
        answer, plain_answer, where = ask(args, messages, prediction)
        reply, plain = reply_of(answer), None if plain_answer is None else reply_of(plain_answer)
    sys.stderr.write(stats_line(reply, plain, where, greedy=args.temperature == 0) + "\n")
    try:
        new = match_final_newline(extract_block(reply.text), source.text)
    except NoCodeBlock as e:
        ended = "the token limit (--max-new-tokens)" if reply.finish == "length" else "the model's end of text"
        sys.stderr.write(f"specdecode: error: {e}; the answer ended at {ended} after {len(reply.text)} characters, "
                         f"beginning {reply.text[:160]!r}; {source.path} is unchanged\n")
        return 1
    if new == source.text:
        sys.stderr.write(f"apply: the answer leaves {source.path} as it is\n")
    elif args.write:
        backup = write_atomically(source, new)
        sys.stderr.write(f"apply: wrote {source.path} (the old file: {backup})\n")
    else:
        sys.stdout.write(unified_diff(source.text, new, source.path.as_posix().lstrip("/")))
    return 0
