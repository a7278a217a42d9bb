"""Which slot serves a request, with the prompt cache (LM.keep_prefix) on: the idle slot that holds at least half
its prompt (a conversation's next turn goes back to the slot that holds the earlier ones), else the least recently
used (a prompt that shares only a system prompt with the others does not evict another conversation's text). The
rule llama-server picks its slots by (prompt similarity over 0.5, else the least recently used)."""

from __future__ import annotations


def held(engine, job) -> int:
    """Prompt tokens of `job` that this engine's target cache holds for it (0 unless the same scope left them)."""
    ids = getattr(job.stream, "prompt_ids", None)
    return engine.target.cached_prefix(ids, getattr(job.stream, "cache_scope", None)) if ids else 0


def slot_for(job, engines: list, idle: list[int], used: list[float], i: int) -> int:
    """The slot among `idle` (worker i's own included) that should serve `job`; `used`: when each slot last ended a
    job. Ties stay with i; without a prompt cache, i."""
    if getattr(job.stream, "cache_scope", None) is None:
        return i
    have = {j: held(engines[j], job) for j in idle}
    best = max(idle, key=lambda j: (have[j], j == i))
    if 2 * have[best] >= len(job.stream.prompt_ids):
        return best
    return min(idle, key=lambda j: (used[j], j != i))
