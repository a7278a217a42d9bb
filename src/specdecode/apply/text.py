"""What `specdecode apply` does to text: the request (the file in a chat prompt that asks for the whole updated file
in one code block, and that block as the prediction), the new file taken from the answer's code block, the unified
diff, and the file replaced in place with a backup. Plain functions of strings and files, no model."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecDecodeError

LANGUAGES = {
    ".py": "python",
    ".js": "javascript",
    ".ts": "typescript",
    ".tsx": "tsx",
    ".jsx": "jsx",
    ".rs": "rust",
    ".go": "go",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".hpp": "cpp",
    ".java": "java",
    ".kt": "kotlin",
    ".rb": "ruby",
    ".php": "php",
    ".cs": "csharp",
    ".swift": "swift",
    ".sh": "bash",
    ".sql": "sql",
    ".html": "html",
    ".css": "css",
    ".md": "markdown",
    ".json": "json",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".toml": "toml",
    ".xml": "xml",
}
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
        raise SpecDecodeError(
            f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); apply edits text files"
        ) from None
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
    prompt = (
        f"Here is the file `{name}`:\n\n{block}\n\nInstruction: {instruction.strip()}\n\n"
        f"Apply the instruction to the file. Reply with the whole updated file in one {fence}{lang} code block: "
        "every line of it, changed or not, and nothing after the block."
    )
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
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])  # the fence's indent, as CommonMark
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
        raise NoCodeBlock(
            "the model's answer stopped inside its code block (its closing fence never came), so the "
            "file would be cut short"
        )
    return text


def match_final_newline(new: str, old: str) -> str:
    """A code block always ends its last line; a file that did not keep it unended."""
    if new.endswith("\n") and old and not old.endswith("\n"):
        return new[:-1]
    return new


def unified_diff(old: str, new: str, name: str) -> str:
    """`diff -u` of two texts as `git diff` writes it: a/ and b/ names, "\\ No newline at end of file" where due."""
    out = []
    for line in difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{name}", f"b/{name}"
    ):
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


def answer_budget(file_tokens: int, prompt_tokens: int, context: int) -> int:
    """The default max_new_tokens: room for the file once and a half and a margin, within the context."""
    room = context - prompt_tokens
    if room <= 0:
        raise SpecDecodeError(
            f"the prompt (the file and the instruction) has {prompt_tokens} tokens; the model's "
            f"context holds {context}, so no answer fits"
        )
    return min(room, file_tokens * 3 // 2 + ANSWER_MARGIN)
