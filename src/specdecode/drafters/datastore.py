"""The datastore of lookup drafting: a token file built once from the user's files (`specdecode index`),
with a suffix array (pydivsufsort's libdivsufsort) over it, memory-mapped and searched in C. It answers
lookup(text, depth, limit) for the lookup drafter, and gives token frequencies (FR-Spec)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from ..errors import SpecDecodeError, positive_int

DATASTORE_MAX_NGRAM = 16  # a datastore is large: a longer match is a far more specific one
DATASTORE_SEP = 0xFFFFFFFF  # between the documents of a datastore
DATASTORE_VERSION = 1


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


def build_datastore(
    docs, out: str | Path, fingerprint: str, *, vocab_size: int, info: dict | None = None, progress: bool = True
) -> dict:
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
    if (n_tokens + n_docs) * 4 >= 2**40:
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
    meta = {
        "version": DATASTORE_VERSION,
        "tokens": n_tokens,
        "documents": n_docs,
        "fingerprint": fingerprint,
        "vocab_size": vocab_size,
        "sort_s": round(time.perf_counter() - t, 1),
        **(info or {}),
    }
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
            raise SpecDecodeError(
                f"{path} is not a complete specdecode datastore ({e}); build it again with `specdecode index`"
            ) from e
        if (
            self.meta.get("version") != DATASTORE_VERSION
            or len(self.sa) != len(self.tokens)
            or self.meta.get("tokens", -1) + self.meta.get("documents", -1) != len(self.tokens)
        ):
            raise SpecDecodeError(f"{path}: a datastore of another version or a damaged one; build it again")
        if fingerprint is not None and self.meta.get("fingerprint") != fingerprint:
            raise SpecDecodeError(
                f"the datastore {path} was built with a different tokenizer "
                f"({self.meta.get('tokenizer', 'unknown')}); build it with this model's"
            )
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
            chunk = np.asarray(self.tokens[i : i + step], dtype=np.int64)
            chunk = chunk[chunk != DATASTORE_SEP]
            freq += np.bincount(chunk, minlength=len(freq))[: len(freq)]
        try:
            np.save(path, freq)
        except OSError:
            pass  # a read-only datastore: computed again next time
        return freq

    def top_tokens(self, k: int) -> list[int]:
        """The k most frequent token ids (ties: the lower id)."""
        positive_int("the draft vocabulary size", k)
        freq = self.frequencies()
        return np.argsort(-freq, kind="stable")[:k].tolist()

    def count(self, pattern: list[int]) -> tuple[int, int]:
        """(occurrences of the token sequence, the first of them in the suffix array)."""
        P = np.asarray(pattern, dtype=">u4").tobytes()
        left = self._int()
        c = self._search(
            self._T,
            self._int(len(self._bytes)),
            P,
            self._int(len(P)),
            self._SA,
            self._int(len(self.sa)),
            ctypes.byref(left),
        )
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
                row = row[: row.index(DATASTORE_SEP)]
            out.append(row[: max(0, len(self.tokens) - end)])
        return out


TEXT_SUFFIXES = (
    ".py",
    ".pyi",
    ".md",
    ".rst",
    ".txt",
    ".json",
    ".toml",
    ".yaml",
    ".yml",
    ".cfg",
    ".ini",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".rs",
    ".go",
    ".java",
    ".js",
    ".ts",
    ".sh",
    ".html",
    ".css",
    ".sql",
    ".tex",
)


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


def index_files(
    paths: list[str],
    tokenizer,
    out: str | Path,
    *,
    suffixes=TEXT_SUFFIXES,
    progress: bool = True,
    info: dict | None = None,
    batch: int = 64,
) -> dict:
    """`specdecode index`: tokenize every file (one document each; undecodable bytes replaced) with
    the target's tokenizer and build a datastore in `out`."""
    files = text_files(paths, suffixes)
    vocab_size = len(tokenizer.get_vocab())

    def docs():
        from tqdm import tqdm

        bar = tqdm(
            total=sum(f.stat().st_size for f in files),
            unit="B",
            unit_scale=True,
            desc="tokenizing",
            disable=not progress,
        )
        for i in range(0, len(files), batch):
            chunk = files[i : i + batch]
            texts = [f.read_text(encoding="utf-8", errors="replace") for f in chunk]
            keep = [t for t in texts if t.strip()]
            if keep:  # a fast tokenizer encodes a batch on every core
                yield from tokenizer(keep, add_special_tokens=False)["input_ids"]
            bar.update(sum(f.stat().st_size for f in chunk))
        bar.close()

    info = {"files": len(files), "tokenizer": getattr(tokenizer, "name_or_path", ""), **(info or {})}
    return build_datastore(
        docs(), out, tokenizer_fingerprint(tokenizer), vocab_size=vocab_size, progress=progress, info=info
    )
