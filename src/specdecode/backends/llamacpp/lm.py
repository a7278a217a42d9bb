"""A GGUF model on llama.cpp's CPU kernels, with its KV cache: the same LM interface as torch_lm.CachedLM.

It drives llama.cpp through llama-cpp-python's low-level C API (`llama_batch`, `llama_decode`,
`llama_get_logits`, `llama_memory_seq_cp/seq_rm`), never its high-level generation.

Token trees live in llama.cpp's multi-sequence KV cache (one unified buffer). A query token sees
every cell that holds its FIRST sequence id, at a position <= its own. So:
- the trunk (committed text) is sequence 0, cell i at position i;
- every tree node gets a sequence id of its own, at position = its depth below the trunk. Before
  the pass, the node's id is copied onto the path it hangs from (`seq_cp` of the nearest ancestor
  already cached, over positions up to that ancestor's); in the pass, every ancestor fed in the
  same batch carries the ids of its descendants as extra ids. A node thus sees exactly the trunk,
  its ancestors and itself: the same attention as CachedLM's tree mask.
- `rollback(length, path)` keeps a prefix and the accepted branch: `seq_cp` of the branch's last
  node into sequence 0 (over the branch's positions), then `seq_rm` of every tree id. No
  recomputation and no copying of keys or values.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from ...errors import EngineUnavailable, Interrupted, SpecDecodeError
from .. import compute
from ..base import LM, no_autograd
from .amx import amx_usable

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence 0 is the trunk, so a tree pass holds at most 255 nodes
N_BATCH = 512  # tokens per llama_decode call (a longer causal feed is split)
MAX_CTX = 32768  # default context cap
PARK = MAX_SEQ - 1  # exact mode: the sequence id that holds parked cells (seen by no query)
# The context starts with this many cells and doubles while a generation needs more (reserve, sized up front for the
# prompt and max_new_tokens): without flash attention values are stored transposed with a row stride of the cell
# count, so a big context slows every decode step (measured: docs/results/notes.md#code-first-ctx).
FIRST_CTX = 4096
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # ImportError, or OSError from a library built for another CPU
        return False
    return True


_initialised = False


def _lib():
    """llama_cpp's C bindings, initialised once, with llama.cpp's log silenced (errors we raise)."""
    global _initialised, _SILENT  # _SILENT kept alive: llama.cpp holds its C pointer
    try:
        import llama_cpp as lc
    except ImportError as e:
        raise SpecDecodeError(
            "the llama.cpp backend needs llama-cpp-python: pip install llama-cpp-python==0.3.36 "
            f"(builds from source, about 5 minutes) ({e})"
        ) from None
    if not _initialised:
        _SILENT = lc.llama_log_callback(_silent_log)
        lc.llama_backend_init()
        lc.llama_log_set(_SILENT, ctypes.c_void_p(0))
        _initialised = True
    return lc


def _silent_log(level, text, user_data):
    if os.environ.get("SPECDECODE_LLAMA_LOG"):
        os.write(2, text or b"")


_SILENT = None  # llama_cpp is imported on first use only: a torch-only run never loads llama.cpp's libraries


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class LlamaLM(LM):
    """A GGUF model in a llama.cpp context. forward/rollback/reset behave like CachedLM's."""

    backend = "llama.cpp"
    max_tree_nodes = MAX_SEQ - 1  # sequence 0 is the trunk: one sequence id per tree node
    seq0, park = 0, PARK  # the trunk's sequence id and exact mode's parking one (a batch slot has its own)
    batch_error = None  # several generations share passes: batching.SharedContext

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int | None = None,
        threads: int | None = None,
        exact: bool = False,
        repack: bool = True,
        f32_kv: bool = False,
        flash_attn: int | None = None,
    ):
        """exact: passes can compute each token's logits bit for bit as a pass of that token alone would (exact
        greedy mode): flash attention on (one query row at a time; plain attention's matrix products change
        kernels with the pass size), and rejected tree nodes below an accepted one kept as parked cells (attention
        sums cells in cache order: later text must not fill those holes). exactness.py measures which pass sizes
        stay exact: 1-3 with repacked weights (repack, the default: groups of 4 take another kernel); 1-7 without
        (K-quants go tiled from 8), but a 1-token pass is slower (docs/results/notes.md#code-flash-attention).
        f32_kv: F32 keys/values, flash attention off (slower). Logits still depend on the cells' order: attention
        sums over cells in cache order (docs/design/exactness.md#rollback-layout).
        flash_attn: a LLAMA_FLASH_ATTN_TYPE_* (default: off, as llama-cpp-python's Llama runs plain decoding, a
        little faster on CPUs; measured: docs/results/notes.md#code-flash-attention)."""
        lc = self._lc = _lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise SpecDecodeError(f"GGUF file not found: {self.path}")
        if exact and f32_kv:
            raise SpecDecodeError("exact (flash attention on) and f32_kv (flash attention off) exclude each other")
        self.exact = bool(exact)
        self.repack = repack = bool(repack) and amx_usable(self.path, lc)  # gemm per 4 tokens, unless AMX crashes
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = repack
        self._model = lc.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise SpecDecodeError(
                f"llama.cpp could not load {self.path} (is the file complete and a GGUF model "
                "of an architecture this llama.cpp knows?)"
            )
        self._ctx = None
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.vocab_size = int(lc.llama_vocab_n_tokens(self._vocab))
        self.threads = threads or default_threads()
        train = int(lc.llama_model_n_ctx_train(self._model))
        cparams = lc.llama_context_default_params()
        limit = self._limit = n_ctx or min(train, MAX_CTX)
        # room for a full tree of drafted tokens beyond the last position the text may reach
        cparams.n_ctx = min(limit, FIRST_CTX) + MAX_SEQ
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = MAX_SEQ
        cparams.kv_unified = True  # one KV buffer that all sequences share: a tree shares its trunk
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED if flash_attn is None else flash_attn
        if exact:
            cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
            self.max_tree_nodes = MAX_SEQ - 2  # one more sequence id holds the parked cells
        if f32_kv:
            cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cparams.type_k = cparams.type_v = lc.GGML_TYPE_F32
        self._cparams = cparams
        self._new_context(cparams.n_ctx)
        self._batch = lc.llama_batch_init(N_BATCH, 0, MAX_SEQ)
        self.max_length = limit  # positions of text: 0 .. max_length-1 (the context grows up to it)
        self.device = torch.device("cpu")
        self.dtype = _FILE_TYPES.get(int(self.meta("general.file_type") or -1), "gguf")
        self.name = self.meta("general.name") or self.path.stem
        self.eos_token_ids = {t for t in (lc.llama_vocab_eos(self._vocab), lc.llama_vocab_eot(self._vocab)) if t >= 0}
        self.eog_ids = frozenset(t for t in range(self.vocab_size) if lc.llama_vocab_is_eog(self._vocab, t))
        self.n_params = int(lc.llama_model_n_params(self._model))
        self.quant_info = None  # set by loading.load_lm when it requantized the file for a draft
        self.reset()

    @property
    def gguf_path(self) -> Path:
        return self.path

    def tolerances(self) -> dict:
        """Rollback: 0, bit for bit (place_chain writes the same cells in a pass of the same size, so the same
        sums run in the same order). Greedy: a 4+ token pass moves a logit by up to ~0.5 on quantized models."""
        return {"rollback": 0.0, "tie": 0.5}

    def place_chain(self, ids: list[int], slots: list[int], size: int, filler: int) -> None:
        """LM.place_chain: the fillers on a sequence id of their own (no chain token sees them), dropped after the
        pass as rollback drops rejected nodes (exact mode parks those before the chain's last token, as rollback
        does). A ubatch takes the free cells from llama.cpp's head in batch order, so slot k is cell start + k."""
        lc, start = self._lc, len(self.ids)
        if (
            self.trunk != start
            or len(slots) != len(ids)
            or list(slots) != sorted(set(slots))
            or not ids
            or not 0 <= slots[0] <= slots[-1] < size <= N_BATCH
            or start + size + self.parked > self._cells
        ):
            raise SpecDecodeError(
                f"place_chain: {len(ids)} tokens at slots {slots} of a {size}-token pass need "
                f"ascending slots inside the pass, no tree cached and room ({start} cached)"
            )
        sid, chain, fillers, tokens = self._free[-1], iter(ids), [], []
        for s in range(size):  # a filler's position: its rank among the fillers (a sequence of its own)
            tokens.append(
                (next(chain), start + s - len(fillers), [self.seq0], False)
                if s in slots
                else (filler, len(fillers), [sid], False)
            )
            fillers += [] if s in slots else [s]
        self._decode(tokens)
        if self.exact:
            for p, s in enumerate(fillers):
                if s < slots[-1]:
                    lc.llama_memory_seq_cp(self._mem, sid, self.park, p, p + 1)
                    self.parked += 1
        lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
        self.ids.extend(ids)
        self.trunk = len(self.ids)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._lc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def kv_cell_bytes(self) -> int:
        """Bytes of keys and values one cache cell holds over every layer (F16, or F32 with f32_kv)."""
        lc, m = self._lc, self._model
        heads = max(1, int(lc.llama_model_n_head(m)))
        per_head = int(lc.llama_model_n_embd(m)) // heads
        size = 4 if self._cparams.type_k == lc.GGML_TYPE_F32 else 2
        return int(lc.llama_model_n_layer(m)) * 2 * int(lc.llama_model_n_head_kv(m)) * per_head * size

    def describe(self) -> str:
        """What pass costs depend on: the file, the llama.cpp build, the threads."""
        st = self.path.stat()
        return "|".join(
            [
                "llama.cpp",
                getattr(self._lc, "__version__", "?"),
                str(self.path.resolve()),
                str(st.st_size),
                str(st.st_mtime_ns),
                self.dtype,
                str(self.threads),
                f"fa{self._cparams.flash_attn_type}-ctx{FIRST_CTX}"
                + ("-exact" if self.exact else "")
                + ("" if self.repack else "-norepack"),
            ]
        )

    def synchronize(self) -> None:
        self._lc.llama_synchronize(self._ctx)

    def __del__(self):
        lc = getattr(self, "_lc", None)
        if lc is None:
            return
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    def _new_context(self, cells: int) -> None:
        lc = self._lc
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        self._cparams.n_ctx = self._asked = max(cells, N_BATCH)  # llama.cpp caps a batch at the context's size
        self._ctx = lc.llama_init_from_model(self._model, self._cparams)
        if not self._ctx:
            raise EngineUnavailable(
                f"llama.cpp could not create a context for {self.path} (n_ctx={cells}; out of memory?)"
            )
        self._mem = lc.llama_get_memory(self._ctx)
        self._cells = int(lc.llama_n_ctx(self._ctx))

    def reserve(self, n: int) -> None:
        """Make room for n tokens of text (and a tree beyond them): FIRST_CTX cells, doubled until they hold n, up to
        max_length. A context bigger than that shrinks back, with the text it holds (a bigger one makes every step
        slower and holds more memory; a server's kept prompt prefix is no reason to keep it big); one too small grows.
        Either way the cached text moves into the new context (_move)."""
        n = min(n, self.max_length)
        cells = min(self.max_length, FIRST_CTX)
        while cells < n:
            cells = min(2 * cells, self.max_length)
        want = max(cells + MAX_SEQ, N_BATCH)
        if want < self._asked and (not self.ids or (not self.exact and self.trunk == len(self.ids))):
            self._move(want)  # smaller, where the text moves without a pass (exact mode would read it again)
            return
        if n + MAX_SEQ + self.parked <= self._cells:
            return
        if self.trunk != len(self.ids):
            raise EngineUnavailable("the llama.cpp context can grow only between passes (no tree cached)")
        self._move(want)

    def _move(self, cells: int) -> None:
        """A new context of `cells` cells that holds the committed text cached now: its keys and values copied over,
        bit for bit and without a pass. Exact mode (or where the copy fails) reads the text again, in the passes plain
        decoding read it in (the prompt in passes of n_batch, then one token a pass), so that every cell holds what
        plain decoding's does and parked cells are left behind; the interrupt is asked between those passes."""
        text, prompt = list(self.ids), self.prompt_read
        state = self._text_state() if text and not self.exact else None
        self._new_context(cells)
        self.reset()
        if state is not None and self._lc.llama_state_seq_set_data(self._ctx, state, len(state), self.seq0):
            self.ids, self.trunk, self.prompt_read = text, len(text), prompt
            return
        self.reset()  # whatever a failed copy left
        head, a = (min(prompt, len(text)) if self.exact else len(text)), 0
        while a < len(text):
            step = self.feed_step(head - a) if a < head else 1
            self.forward(text[a : a + step], last_only=True)
            a += step
            self.prompt_read = min(prompt, a)
            if a < len(text) and self.interrupt is not None and self.interrupt():
                raise Interrupted

    def _text_state(self):
        """The keys and values of the trunk (sequence 0) as llama.cpp serialises them; None if it cannot."""
        lc = self._lc
        size = int(lc.llama_state_seq_get_size(self._ctx, self.seq0))
        buf = (ctypes.c_uint8 * size)()
        return buf if size and lc.llama_state_seq_get_data(self._ctx, buf, size, self.seq0) == size else None

    def reset(self) -> None:
        self._lc.llama_memory_clear(self._mem, False)  # metadata only: no memset of the buffers
        self.ids: list[int] = []  # token ids whose keys/values are cached, in cache order
        self.trunk = 0  # entries [0, trunk) are committed text: sequence 0, entry i at position i
        self.parent: list[int] = []  # for tree entries (index >= trunk): cache index of the parent
        self.pos: list[int] = []  # for tree entries: position (trunk length + depth - 1)
        self.seq: list[int] = []  # for tree entries: the entry's own sequence id
        self._free = list(range(MAX_SEQ - 1, 0, -1))  # unused sequence ids (pop from the end)
        if self.exact:
            self._free.remove(PARK)
        self.parked = 0  # cells held by PARK (exact): rejected tree nodes below an accepted one
        self.prompt_read = 0

    def __len__(self) -> int:
        return len(self.ids)

    def _position(self, i: int) -> int:
        return i if i < self.trunk else self.pos[i - self.trunk]

    def _seq_of(self, i: int) -> int:
        return self.seq0 if i < self.trunk else self.seq[i - self.trunk]

    def _parent(self, i: int) -> int:
        return i - 1 if i < self.trunk else self.parent[i - self.trunk]

    def feed_step(self, left: int) -> int:  # tokens of a causal feed's (a prompt's) next pass, `left` still to read
        return min(left, N_BATCH)

    @no_autograd
    def forward(self, new_ids: list[int], last_only: bool = False, parents: list[int] | None = None) -> torch.Tensor:
        """Append new_ids; return float32 logits [len(new_ids), V] (or [1, V] if last_only).
        parents: as in CachedLM.forward (cache indices after the append; None = a causal chain)."""
        n = len(new_ids)
        if not n:
            raise ValueError("forward needs at least one token")
        start = len(self.ids)
        if start + n + self.parked > self._cells and start + n <= self.max_length + MAX_SEQ and self.trunk == start:
            self.reserve(start + n)
        if start + n + self.parked > self._cells:
            raise EngineUnavailable(
                f"llama.cpp context overflow: {start} + {n} tokens (+ {self.parked} parked cells) "
                f"> {self._cells} cache cells"
            )
        bad = [t for t in new_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {self.vocab_size}")
        chain = list(range(start - 1, start - 1 + n))
        parents = chain if parents is None else list(parents)
        if len(parents) != n:
            raise ValueError(f"{n} tokens but {len(parents)} parents")
        # leading tokens that continue the trunk and that every later token descends from join the trunk
        j, later = 0, [start + n] * n  # later[i]: the smallest parent after token i (linear, not quadratic)
        for i in range(n - 2, -1, -1):
            later[i] = min(later[i + 1], parents[i + 1])
        while self.trunk == start and j < n and parents[j] == start + j - 1 and later[j] >= start + j:
            j += 1
        if j == n:  # a causal chain: in passes of feed_step tokens
            out, a = [], 0
            while a < n:
                chunk = new_ids[a : a + self.feed_step(n - a)]  # asked each pass: a batch slot's changes
                last, want = a + len(chunk) == n, len(chunk) - 1
                rows = self._decode(
                    [
                        (t, start + a + k, [self.seq0], not last_only or (last and k == want))
                        for k, t in enumerate(chunk)
                    ]
                )
                out += [] if rows is None else [rows]
                self.ids.extend(chunk)
                self.trunk, a = len(self.ids), a + len(chunk)
            return torch.from_numpy(out[0] if len(out) == 1 else np.concatenate(out))
        return self._tree_pass(new_ids, parents, j, last_only)

    def _tree_pass(self, new_ids, parents, n_trunk, last_only) -> torch.Tensor:
        lc, start, n = self._lc, len(self.ids), len(new_ids)
        if n > N_BATCH:
            raise SpecDecodeError(f"a tree pass of {n} tokens exceeds llama.cpp's batch of {N_BATCH}")
        if n - n_trunk > len(self._free):
            raise SpecDecodeError(
                f"the llama.cpp backend holds at most {self.max_tree_nodes} tree nodes in its cache "
                f"({n - n_trunk} more were fed with {len(self.ids) - self.trunk} cached)"
            )
        trunk_after = self.trunk + n_trunk
        for b in range(n_trunk, n):  # all checks before any sequence id is taken
            par = parents[b]
            if not -1 <= par < start + b:
                raise ValueError(f"token {b} of a tree pass has parent {par}; a parent must come before it")
            if par < trunk_after and par != trunk_after - 1:
                raise ValueError(
                    f"token {b} of a tree pass hangs off entry {par}, inside the committed text; "
                    f"a tree hangs off its last entry ({trunk_after - 1})"
                )
        seqs = [[self.seq0] for _ in range(n_trunk)]  # the batch's sequence ids per token (own id first)
        pos = list(range(start, start + n_trunk))
        new_parent, new_seq = [], []
        for b in range(n_trunk, n):
            par = parents[b]
            sid = self._free.pop()
            seqs.append([sid])
            new_parent.append(par)
            new_seq.append(sid)
            pos.append(0 if par < 0 else (pos[par - start] if par >= start else self._position(par)) + 1)
            a = par  # in-batch ancestors carry this node's id; the nearest cached one lends its path
            while a >= start:
                seqs[a - start].append(sid)
                a = parents[a - start]
            if a >= 0:
                src = self._seq_of(a)
                lc.llama_memory_seq_cp(self._mem, src, sid, -1, -1 if src == self.seq0 else self._position(a) + 1)
        try:
            rows = self._decode([(new_ids[b], pos[b], seqs[b], not last_only or b == n - 1) for b in range(n)])
        except BaseException:  # give the ids back, and drop whatever the failed pass left in the cache
            for sid in new_seq:
                lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
                self._free.append(sid)
            lc.llama_memory_seq_rm(self._mem, self.seq0, start, -1)
            raise
        self.ids.extend(new_ids)
        self.trunk = trunk_after
        self.parent.extend(new_parent)
        self.pos.extend(pos[n_trunk:])
        self.seq.extend(new_seq)
        return torch.from_numpy(rows)

    def _decode(self, tokens: list[tuple[int, int, list[int], bool]]) -> np.ndarray | None:
        """One llama_decode over (token, position, sequence ids, wants logits); logits rows in order."""
        lc, batch = self._lc, self._batch
        n_out = 0
        for i, (tok, p, seqs, want) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, p, len(seqs)
            for k, s in enumerate(seqs):
                batch.seq_id[i][k] = s
            batch.logits[i] = want
            n_out += want
        batch.n_tokens = len(tokens)
        rc = compute.call(lc.llama_decode, self._ctx, batch)  # one thread for every pass (compute.py)
        if rc != 0:
            raise EngineUnavailable(
                f"llama_decode failed with status {rc} ({len(tokens)} tokens, "
                f"{len(self.ids)} cached, n_ctx {self.max_length})"
            )
        if not n_out:
            return None
        ptr = lc.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.vocab_size)).copy()

    def rollback(self, length: int, path: list[int] = ()) -> None:
        """Keep the first `length` cached entries, then the entries at `path` (an accepted tree branch
        hanging off entry length-1). Everything else is forgotten."""
        lc = self._lc
        length, path = self._branch(length, path)
        m, k = min(length, self.trunk), 0  # keep = [0, length) + path: its first m entries are a trunk prefix
        while m == length + k < self.trunk and k < len(path) and path[k] == m:
            m, k = m + 1, k + 1
        branch = path[k:] if m >= length else list(range(m, length)) + path
        if not path and length > self.trunk:  # rolled back inside the tree: keep those nodes as they are
            for sid in self.seq[length - self.trunk :]:
                lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
                self._free.append(sid)
            k = length - self.trunk
            self.ids, self.parent, self.pos, self.seq = self.ids[:length], self.parent[:k], self.pos[:k], self.seq[:k]
            return
        if branch:  # the accepted branch joins sequence 0 at the positions it was computed at
            last = branch[-1]
            lc.llama_memory_seq_cp(self._mem, self._seq_of(last), self.seq0, self.trunk, self._position(last) + 1)
            if self.exact:  # a rejected node below the last accepted one keeps its cell, under PARK
                kept = set(branch)
                for i in range(self.trunk, last):
                    if i not in kept:
                        p = self._position(i)
                        lc.llama_memory_seq_cp(self._mem, self._seq_of(i), self.park, p, p + 1)
                        self.parked += 1
        for sid in self.seq:
            lc.llama_memory_seq_rm(self._mem, sid, -1, -1)
            self._free.append(sid)
        new_len = m + len(branch)
        if not lc.llama_memory_seq_rm(self._mem, self.seq0, new_len, -1):
            raise SpecDecodeError("llama.cpp could not roll back this model's cache (recurrent state?)")
        self.ids = self.ids[:m] + [self.ids[i] for i in branch]
        self.trunk = new_len
        self.parent, self.pos, self.seq = [], [], []
