"""Where the waiting passes of one shared llama.cpp context are cut into llama_decode calls (SharedContext.decode).

A call's cost is its size's in the measured table of whole calls, plus, where it mixes generations and llama.cpp's
CPU flash attention runs it as tiles, what those tiles cost for the other generations' cells. Tiles: a call of
FA_TILE tokens or more is computed in tiles of FA_TILE query rows (GGML_FA_TILE_Q), and a tile skips a block of cache
cells only where every row of it is masked there. A tile holding rows of two generations computes every block
either of them sees: a prompt's chunk beside the one-token steps of generations far into their texts computes their
cells too (measured: docs/results/notes.md#code-mixed-tiles). A call under FA_TILE tokens attends row by row and
skips each masked cell: mixing costs nothing there.
"""

from __future__ import annotations

import time
from typing import Callable

from .lm import N_BATCH

FA_TILE = 64  # tokens of a call from which llama.cpp's CPU flash attention runs it in tiles (GGML_FA_TILE_Q)


def mixing(sizes: list[int], cells: list[int], in_use: int, per_cell: float) -> float:
    """Seconds one call of these passes (their token counts, and the cache cells each one's generation holds) spends
    on tiles that mix generations, if it is tiled (FA_TILE tokens or more) and holds several: `per_cell`
    (time_mixing) for each of the `in_use` cells of the cache (every generation's) but the cells of the
    biggest pass's generation. Not only the mixed-in generations' own: a decoding generation's cells lie one or a
    few per step between everyone's, so a tile holding its row reads nearly every block of the cache (measured:
    docs/results/notes.md#code-mixed-tiles)."""
    if len(sizes) < 2 or sum(sizes) < FA_TILE or per_cell <= 0:
        return 0.0
    big = max(range(len(sizes)), key=sizes.__getitem__)
    return per_cell * max(0, in_use - cells[big])


def plan_split(
    sizes: list[int],
    cost: Callable[[int], float] | None,
    cap: int = N_BATCH,
    cells: list[int] | None = None,
    in_use: int = 0,
    per_cell: float = 0.0,
) -> list[int]:
    """Where to cut a list of passes (their token counts, in order) into llama_decode calls: the cut that
    costs least by `cost` (seconds of one whole call over n tokens of several generations, as
    SharedContext.time_calls measures it; None: one call per N_BATCH tokens) plus `mixing` (cells: each pass's
    generation's cache cells; in_use: the cache's; per_cell: what a mixed tile spends on each), with every call at
    most `cap` tokens. Returns the number of passes in each call."""
    n = len(sizes)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        total = 0
        for i in range(j - 1, -1, -1):  # the call holding passes i .. j-1
            total += sizes[i]
            if total > cap and i < j - 1:
                break
            c = best[i] + (cost(total) if cost is not None else 1.0)
            if cells is not None and cost is not None:
                c += mixing(sizes[i:j], cells[i:j], in_use, per_cell)
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j:
        groups.append(j - cut[j])
        j = cut[j]
    return groups[::-1]


def time_mixing(shared, context: int = 128, far: int = 1024, repeats: int = 3) -> float:
    """Seconds a tiled call on SharedContext `shared` spends per cache cell of another generation it mixes in
    (mixing): one slot's chunk of FA_TILE - 1 tokens with one step of another slot, that slot `context` cells in
    and then `context + far`; the fastest of `repeats` each. 0.0 with one slot, or where a slot holds too few cells
    (under FA_TILE more). Run it while no generation is live."""
    a, b = shared.slots[0], shared.slots[-1]
    far = min(far, b.max_length - context - 1, a.max_length - context - FA_TILE)
    if a is b or far < FA_TILE:
        return 0.0
    text = [(7 * i + 11) % min(1000, shared.lm.vocab_size) for i in range(context + far)]

    def timed(step_at: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            tokens = [(1, context + k, [a.seq0], k == FA_TILE - 2) for k in range(FA_TILE - 1)]
            t = time.perf_counter()
            shared._decode(tokens + [(1, step_at, [b.seq0], True)])
            best = min(best, time.perf_counter() - t)
            shared._lc.llama_memory_seq_rm(shared.mem, a.seq0, context, -1)
            shared._lc.llama_memory_seq_rm(shared.mem, b.seq0, step_at, -1)
        return best

    try:
        for slot in (a, b):
            slot.reset()
            slot.forward(text[:context], last_only=True)
        near = timed(context)
        b.forward(text[context:], last_only=True)
        return max(0.0, (timed(context + far) - near) / far)
    finally:
        a.reset()
        b.reset()
