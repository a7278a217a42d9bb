"""A faster draft on llama.cpp: requantize its GGUF file once, into whichever type is fastest here.

Draft weights never change the output's distribution (the target verifies every token), so the draft may run in
whichever llama.cpp type is fastest on this machine. Candidates: the file as shipped, and DRAFT_QUANTS.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from pathlib import Path

from ...errors import SpecDecodeError
from ...host import write_json
from .lm import LlamaLM, _lib, default_threads

DRAFT_QUANTS = {"Q4_0": 2, "Q8_0": 7}  # name -> llama_ftype (LLAMA_FTYPE_MOSTLY_*)


def requantize(src: Path, name: str, threads: int | None = None) -> Path:
    """src requantized to `name` (a DRAFT_QUANTS key), written once into the cache (seconds)."""
    from ...host import cache_dir

    lc = _lib()
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{src.stem}-{key}-{name}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".quantizing-{os.getpid()}-{out.name}")
    params = lc.llama_model_quantize_default_params()
    params.ftype = DRAFT_QUANTS[name]
    params.allow_requantize = True
    params.nthread = threads or default_threads()
    try:
        if lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SpecDecodeError(f"llama.cpp could not requantize {src} to {name}")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def one_token_seconds(lm: "LlamaLM", repeats: int = 7, context: int = 128) -> float:
    """The fastest of `repeats` 1-token passes after `context` cached tokens."""
    lm.reset()
    lm.forward([(7 * i + 11) % min(1000, lm.vocab_size) for i in range(context)], last_only=True)
    best = float("inf")
    for _ in range(repeats):
        lm.rollback(context)
        t = time.perf_counter()
        lm.forward([1])
        best = min(best, time.perf_counter() - t)
    lm.reset()
    return best


def fastest_draft(src: Path, threads: int | None = None, progress: bool = True) -> tuple[Path, dict]:
    """The draft file to run: src or one of its requantizations, whichever makes the fastest 1-token
    pass on this machine. Measured once per machine, file, llama.cpp build and thread count; the
    choice and the timings are cached under the cache dir's costs/ and returned as a report."""
    from ...host import cache_dir, cpu_name as _cpu_name

    threads = threads or default_threads()
    lc = _lib()
    st = src.stat()
    key = hashlib.sha256(
        "|".join(
            [
                _cpu_name(),
                str(threads),
                getattr(lc, "__version__", "?"),
                str(src.resolve()),
                str(st.st_size),
                str(st.st_mtime_ns),
            ]
        ).encode()
    ).hexdigest()[:16]
    record = cache_dir() / "costs" / f"draft-quant-{key}.json"
    if record.is_file():
        try:
            info = json.loads(record.read_text())
            path = src if info["chosen"] == "original" else requantize(src, info["chosen"], threads)
            return path, info
        except (ValueError, KeyError, TypeError, SpecDecodeError):
            pass  # a damaged record: measure again
    from tqdm.auto import tqdm

    seconds, types = {}, {}
    for name in tqdm(
        ["original", *DRAFT_QUANTS],
        desc="choosing the draft's fastest quantization (once)",
        disable=not progress,
        leave=False,
    ):
        path = src if name == "original" else requantize(src, name, threads)
        lm = LlamaLM(path, n_ctx=512, threads=threads)
        seconds[name], types[name] = one_token_seconds(lm), lm.dtype
        del lm
    chosen = min(seconds, key=seconds.get)
    info = {"chosen": chosen, "file_type": types, "one_token_s": seconds}
    write_json(record, info, indent=1)
    return (src if chosen == "original" else requantize(src, chosen, threads)), info
