"""Lookup drafting: guesses that cost (almost) nothing, read from text seen before.

Three sources, each an index that finds where the last tokens of the text occurred before and what
followed them there:
- "context": the current prompt and output (an n-gram table that grows with the text);
- "history": the engine's earlier outputs, each with the end of its prompt (the same n-gram table over
  all of them; bounded, the least recently used output evicted first);
- "datastore": a token datastore built once from the user's files (`specdecode index`): a suffix
  array (pydivsufsort's libdivsufsort) over a memory-mapped token file, searched in C.

Each source matches the longest suffix of the text it holds (up to its max n-gram length), and the
continuations of up to MAX_MATCHES of those occurrences (the latest ones for the context and the
history, evenly spaced ones for the datastore) form a tree whose nodes count how many continuations
pass through them: freq = count(node) / count(parent) is the observed P(token | path). The tree
planner (tree.py) turns (source, n-gram length, freq, depth) into a calibrated acceptance value and
weighs the guesses against the draft model's with the measured pass costs. Every guess is one-hot
(deterministic), so any choice of guesses keeps the target's distribution (verify_tree's contract).
"""
from __future__ import annotations

import bisect
import heapq
import ctypes
import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SpecDecodeError

MAX_NGRAM = 4  # context and history: match up to the last 4 tokens (prompt lookup used 3)
DATASTORE_MAX_NGRAM = 16  # a datastore is large: a longer match is a far more specific one
MAX_MATCHES = 16  # continuations read per source and step (SuffixDecoding and REST use a few dozen)
PROMPT_TAIL = 32  # history: the prompt tokens stored before each output, so that its start can be found
SEP = -1  # between the sequences of an n-gram table
DATASTORE_SEP = 0xFFFFFFFF  # between the documents of a datastore
DATASTORE_VERSION = 1
SOURCES = ("context", "history", "datastore")


@dataclass
class Guess:
    """One node of a lookup tree (parents come before children)."""
    token: int
    parent: int  # index in the guess list, -1 = after the last committed token
    depth: int
    count: int  # continuations through this node
    freq: float  # count / count(parent): the observed P(token | path)
    ngram: int  # length of the matched suffix
    source: str
    refs: tuple = ()  # history: the stored outputs the continuations came from


# ============================================================== n-gram tables (context, history)


class NgramIndex:
    """Every n-gram (n <= max_n) of a growing token list, with the positions just after each of its
    occurrences. Sequences are separated by SEP; no n-gram or continuation crosses a separator."""

    def __init__(self, max_n: int = MAX_NGRAM):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple, list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new) -> None:
        toks, ends = self.tokens, self.ends
        for x in new:
            toks.append(int(x))
            end = len(toks)
            for n in range(1, self.max_n + 1):
                if n > end or toks[end - n] == SEP:
                    break
                ends.setdefault(tuple(toks[end - n:end]), []).append(end)

    def match(self, text: list[int], limit: int, live=None) -> tuple[int, list[int]]:
        """(n, ends): the longest suffix of text (n <= max_n) that occurred with a continuation, and
        the positions after its latest `limit` such occurrences (latest first). live(end) filters."""
        last = len(self.tokens)
        for n in range(min(self.max_n, len(text)), 0, -1):
            found = []
            for end in reversed(self.ends.get(tuple(text[-n:]), ())):
                if end < last and self.tokens[end] != SEP and (live is None or live(end)):
                    found.append(end)
                    if len(found) == limit:
                        break
            if found:
                return n, found
        return 0, []

    def continuation(self, end: int, depth: int) -> list[int]:
        out = self.tokens[end:end + depth]
        return out[:out.index(SEP)] if SEP in out else out

    def lookup(self, text: list[int], depth: int, limit: int) -> tuple[int, list[list[int]], list]:
        """(n, continuations up to depth tokens, their refs): what a source gives the drafter."""
        n, ends = self.match(text, limit)
        return n, [self.continuation(e, depth) for e in ends], [None] * len(ends)


class History:
    """The engine's earlier outputs (each after the last PROMPT_TAIL tokens of its prompt), at most
    max_tokens of them; when full, the least recently used output goes (used = added, or one of its
    guesses accepted). Dead entries are dropped from the table once they outnumber the live ones."""

    def __init__(self, max_tokens: int = 1_000_000, max_n: int = MAX_NGRAM):
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise SpecDecodeError(f"history_tokens must be a non-negative integer, got {max_tokens!r}")
        self.max_tokens, self.max_n = max_tokens, max_n
        self.index = NgramIndex(max_n)
        self.starts: list[int] = []  # start position of every sequence ever stored (dead ones too)
        self.live: OrderedDict[int, int] = OrderedDict()  # sequence -> its length, least recently used first
        self.live_tokens = 0
        self.next_id = 0
        self.ids: list[int] = []  # sequence id of each entry in starts

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        seq = list(prompt_ids[-PROMPT_TAIL:]) + list(output_ids)
        if not output_ids or len(seq) > self.max_tokens:
            return
        while self.live_tokens + len(seq) > self.max_tokens:
            _, n = self.live.popitem(last=False)
            self.live_tokens -= n
        dead = len(self.index) - self.live_tokens - len(self.live)  # tokens (and separators) of dead sequences
        if dead > self.live_tokens + len(self.live):
            self._compact()
        self.starts.append(len(self.index))
        self.ids.append(self.next_id)
        self.index.extend(seq + [SEP])
        self.live[self.next_id] = len(seq)
        self.live_tokens += len(seq)
        self.next_id += 1

    def _compact(self) -> None:
        old, starts, ids = self.index, self.starts, self.ids
        self.index, self.starts, self.ids = NgramIndex(self.max_n), [], []
        for k, (start, seq) in enumerate(zip(starts, ids)):
            if seq in self.live:
                end = starts[k + 1] if k + 1 < len(starts) else len(old)
                self.starts.append(len(self.index))
                self.ids.append(seq)
                self.index.extend(old.tokens[start:end])

    def sequence_at(self, pos: int) -> int:
        return self.ids[bisect.bisect_right(self.starts, pos) - 1]

    def match(self, text: list[int], limit: int) -> tuple[int, list[int]]:
        return self.index.match(text, limit, live=lambda end: self.sequence_at(end) in self.live)

    def lookup(self, text: list[int], depth: int, limit: int) -> tuple[int, list[list[int]], list]:
        """As NgramIndex.lookup; each continuation's ref is the stored output it came from."""
        n, ends = self.match(text, limit)
        return n, [self.index.continuation(e, depth) for e in ends], [self.sequence_at(e) for e in ends]

    def touch(self, seqs) -> None:
        for s in seqs:
            if s in self.live:
                self.live.move_to_end(s)

    def clear(self) -> None:
        self.__init__(self.max_tokens, self.max_n)


# ============================================================== the datastore (suffix array)


def _libdivsufsort():
    import importlib
    try:  # the module (its name is shadowed by the function in the package)
        return importlib.import_module("pydivsufsort.divsufsort")
    except ImportError as e:  # a core dependency: only a broken install lands here
        raise SpecDecodeError("datastores need pydivsufsort (pip install pydivsufsort)") from e


def tokenizer_fingerprint(tokenizer) -> str:
    """The identity of a token space: the same ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def build_datastore(docs, out: str | Path, fingerprint: str, *, vocab_size: int, info: dict | None = None,
                    progress: bool = True) -> dict:
    """Write a datastore from an iterable of token-id lists (documents) into directory `out`:
    tokens.bin (big-endian uint32, documents separated by 0xFFFFFFFF), sa.npy (the suffix array, as
    byte offsets into tokens.bin, sorted by the token sequences that start there) and meta.json."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    n_docs = n_tokens = 0
    tmp = out / "tokens.bin.tmp"
    with open(tmp, "wb") as f:
        for ids in docs:
            ids = np.asarray(ids, dtype=np.int64)
            if not len(ids):
                continue
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise SpecDecodeError(f"token id {int(ids.max())} outside the vocabulary ({vocab_size})")
            f.write(ids.astype(">u4").tobytes() + np.uint32(DATASTORE_SEP).astype(">u4").tobytes())
            n_docs += 1
            n_tokens += len(ids)
    if not n_tokens:
        tmp.unlink()
        raise SpecDecodeError("no tokens to index: the files are empty (or none matched)")
    if (n_tokens + n_docs) * 4 >= 2 ** 40:
        raise SpecDecodeError("a datastore holds at most 2^38 tokens")
    tmp.replace(out / "tokens.bin")
    t = time.perf_counter()
    data = np.fromfile(out / "tokens.bin", dtype=np.uint8)
    if progress:
        print(f"sorting the suffixes of {n_tokens:,} tokens ...", flush=True)
    m = _libdivsufsort()
    wide = len(data) > np.iinfo(np.int32).max
    sa = m.divsufsort(data, force64=wide)  # of every byte; the token starts are the multiples of 4
    sa = sa[sa % 4 == 0]
    np.save(out / "sa.npy", sa)
    del data, sa
    meta = {"version": DATASTORE_VERSION, "tokens": n_tokens, "documents": n_docs, "fingerprint": fingerprint,
            "vocab_size": vocab_size, "sort_s": round(time.perf_counter() - t, 1), **(info or {})}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


class Datastore:
    """A datastore on disk, memory-mapped: lookups read only the few pages they touch."""

    def __init__(self, path: str | Path, fingerprint: str | None = None, max_n: int = DATASTORE_MAX_NGRAM):
        path = Path(path).expanduser()
        if not path.is_dir():
            raise SpecDecodeError(f"datastore not found: {path} (build one with `specdecode index FILES --out DIR`)")
        try:
            self.meta = json.loads((path / "meta.json").read_text())
            self.tokens = np.memmap(path / "tokens.bin", dtype=">u4", mode="r")
            self.sa = np.load(path / "sa.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise SpecDecodeError(f"{path} is not a complete specdecode datastore ({e}); "
                                  "build it again with `specdecode index`") from e
        if self.meta.get("version") != DATASTORE_VERSION or len(self.sa) != len(self.tokens) or \
                self.meta.get("tokens", -1) + self.meta.get("documents", -1) != len(self.tokens):
            raise SpecDecodeError(f"{path}: a datastore of another version or a damaged one; build it again")
        if fingerprint is not None and self.meta.get("fingerprint") != fingerprint:
            raise SpecDecodeError(f"the datastore {path} was built with a different tokenizer "
                                  f"({self.meta.get('tokenizer', 'unknown')}); build it with this model's")
        self.path, self.max_n = path, max_n
        m = _libdivsufsort()
        wide = self.sa.dtype == np.int64
        self._search = m.libdivsufsort64.sa_search64 if wide else m.libdivsufsort.sa_search
        self._int = ctypes.c_int64 if wide else ctypes.c_int32
        self._bytes = self.tokens.view(np.uint8)
        self._T = self._bytes.ctypes.data_as(ctypes.c_char_p)
        self._SA = self.sa.ctypes.data_as(ctypes.POINTER(self._int))

    def __len__(self) -> int:
        return int(self.meta["tokens"])

    def frequencies(self) -> np.ndarray:
        """How often each token id occurs in the datastore [vocab_size] (computed once, cached beside it)."""
        path = self.path / "frequencies.npy"
        try:
            freq = np.load(path)
            if freq.shape == (self.meta["vocab_size"],):
                return freq
        except (OSError, ValueError):
            pass
        freq = np.zeros(self.meta["vocab_size"], dtype=np.int64)
        step = 1 << 24
        for i in range(0, len(self.tokens), step):
            chunk = np.asarray(self.tokens[i:i + step], dtype=np.int64)
            chunk = chunk[chunk != DATASTORE_SEP]
            freq += np.bincount(chunk, minlength=len(freq))[:len(freq)]
        try:
            np.save(path, freq)
        except OSError:
            pass  # a read-only datastore: computed again next time
        return freq

    def top_tokens(self, k: int) -> list[int]:
        """The k most frequent token ids (ties: the lower id)."""
        if not isinstance(k, int) or k <= 0:
            raise SpecDecodeError(f"the draft vocabulary size must be a positive integer, got {k!r}")
        freq = self.frequencies()
        return np.argsort(-freq, kind="stable")[:k].tolist()

    def count(self, pattern: list[int]) -> tuple[int, int]:
        """(occurrences of the token sequence, the first of them in the suffix array)."""
        P = np.asarray(pattern, dtype=">u4").tobytes()
        left = self._int()
        c = self._search(self._T, self._int(len(self._bytes)), P, self._int(len(P)), self._SA,
                         self._int(len(self.sa)), ctypes.byref(left))
        if c < 0:
            raise SpecDecodeError(f"suffix array search failed ({c})")
        return int(c), int(left.value)

    def match(self, text: list[int], limit: int) -> tuple[int, np.ndarray]:
        """(n, ends): the longest suffix of text (n <= max_n) found, and the token positions after up
        to `limit` of its occurrences (evenly spaced in suffix order when there are more)."""
        lo, hi, best = 1, min(self.max_n, len(text)), (0, 0, 0)
        while lo <= hi:  # occurrences never grow with n: binary search for the longest n found
            n = (lo + hi) // 2
            c, left = self.count(text[-n:])
            if c:
                best, lo = (n, c, left), n + 1
            else:
                hi = n - 1
        n, c, left = best
        if not c:
            return 0, np.zeros(0, dtype=np.int64)
        pick = np.arange(c) if c <= limit else np.linspace(0, c - 1, limit).round().astype(np.int64)
        return n, np.asarray(self.sa[left + pick], dtype=np.int64) // 4 + n

    def lookup(self, text: list[int], depth: int, limit: int) -> tuple[int, list[list[int]], list]:
        """As NgramIndex.lookup."""
        n, ends = self.match(text, limit)
        return n, self.continuations(ends, depth), [None] * len(ends)

    def continuations(self, ends: np.ndarray, depth: int) -> list[list[int]]:
        idx = np.minimum(ends[:, None] + np.arange(depth), len(self.tokens) - 1)
        rows = np.asarray(self.tokens[idx], dtype=np.int64)
        out = []
        for row, end in zip(rows.tolist(), ends.tolist()):
            if DATASTORE_SEP in row:
                row = row[:row.index(DATASTORE_SEP)]
            out.append(row[:max(0, len(self.tokens) - end)])
        return out


# ============================================================== the drafter


def continuation_tree(conts: list[list[int]], refs: list, ngram: int, source: str, max_nodes: int) -> list[Guess]:
    """The trie of the continuations with its nodes counted; the max_nodes most likely nodes (by the
    product of freq along the path, best first) are kept, each after its parent."""
    children: dict[tuple, dict[int, list]] = {}  # path -> token -> [count, refs]
    for cont, ref in zip(conts, refs):
        path = ()
        for x in cont:
            node = children.setdefault(path, {}).setdefault(x, [0, set()])
            node[0] += 1
            if ref is not None:
                node[1].add(ref)
            path += (x,)
    guesses: list[Guess] = []
    heap: list = []
    order = 0  # ties: first seen first

    def push(path: tuple, parent: int, prob: float) -> None:
        nonlocal order
        kids = children.get(path, {})
        total = sum(c for c, _ in kids.values())
        for x, (c, r) in kids.items():
            heapq.heappush(heap, (-prob * c / total, order, path + (x,), parent, c, c / total, tuple(sorted(r))))
            order += 1

    push((), -1, 1.0)
    while heap and len(guesses) < max_nodes:
        neg, _, path, parent, c, freq, r = heapq.heappop(heap)
        guesses.append(Guess(path[-1], parent, len(path), c, freq, ngram, source, r))
        push(path, len(guesses) - 1, -neg)
    return guesses


class Lookup:
    """The lookup drafter: one tree of guesses per step from every source it has. Sources: the
    context (always), the engine's History and a Datastore (when given)."""

    def __init__(self, history: History | None = None, datastore: Datastore | None = None,
                 max_matches: int = MAX_MATCHES):
        self.history, self.datastore = history, datastore
        self.max_matches = max_matches
        self.context = NgramIndex()

    def _indexes(self) -> list:
        """(name, index) of every source it has, in SOURCES order: each answers lookup(text, depth, limit)."""
        return [(name, index) for name, index in zip(SOURCES, (self.context, self.history, self.datastore))
                if index is not None]

    @property
    def sources(self) -> list[str]:
        return [name for name, _ in self._indexes()]

    def prefill(self, ids: list[int]) -> None:
        self.context = NgramIndex()
        self.context.extend(ids)

    def reset(self) -> None:
        self.context = NgramIndex()

    def tree(self, ids: list[int], max_depth: int, max_nodes: int) -> list[Guess]:
        """Guesses from every source (each its own tree; context first), parents before children."""
        if len(self.context) < len(ids):
            self.context.extend(ids[len(self.context):])
        out: list[Guess] = []
        for source, index in self._indexes() if max_depth > 0 else ():
            n, conts, refs = index.lookup(ids, max_depth, self.max_matches)
            base = len(out)
            for g in continuation_tree(conts, refs, n, source, max_nodes) if n else ():
                g.parent = g.parent + base if g.parent >= 0 else -1
                out.append(g)
        return out

    def accepted(self, guesses: list[Guess]) -> None:
        """These guesses were accepted: their stored outputs were just used (LRU)."""
        if self.history is not None:
            self.history.touch({r for g in guesses if g.source == "history" for r in g.refs})


# ============================================================== building a datastore from files

TEXT_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt", ".json", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".c", ".h",
                 ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh", ".html", ".css", ".sql", ".tex")


def text_files(paths: list[str], suffixes=TEXT_SUFFIXES) -> list[Path]:
    """The files to index: each file given, and under each directory every file with one of the
    suffixes (sorted, so that a datastore is reproducible)."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        else:
            raise SpecDecodeError(f"no such file or directory: {p}")
    if not files:
        raise SpecDecodeError(f"no files to index under {', '.join(paths)} (suffixes: {' '.join(suffixes)})")
    return files


def index_files(paths: list[str], tokenizer, out: str | Path, *, suffixes=TEXT_SUFFIXES, progress: bool = True,
                info: dict | None = None, batch: int = 64) -> dict:
    """`specdecode index`: tokenize every file (one document each; undecodable bytes replaced) with
    the target's tokenizer and build a datastore in `out`."""
    files = text_files(paths, suffixes)
    vocab_size = len(tokenizer.get_vocab())

    def docs():
        from tqdm import tqdm
        bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="tokenizing",
                   disable=not progress)
        for i in range(0, len(files), batch):
            chunk = files[i:i + batch]
            texts = [f.read_text(encoding="utf-8", errors="replace") for f in chunk]
            keep = [t for t in texts if t.strip()]
            if keep:  # a fast tokenizer encodes a batch on every core
                yield from tokenizer(keep, add_special_tokens=False)["input_ids"]
            bar.update(sum(f.stat().st_size for f in chunk))
        bar.close()

    return build_datastore(docs(), out, tokenizer_fingerprint(tokenizer), vocab_size=vocab_size, progress=progress,
                           info={"files": len(files), "tokenizer": getattr(tokenizer, "name_or_path", ""), **(info or {})})
