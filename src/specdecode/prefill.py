"""A generation's first work: the prompt into the target's cache (and the draft's), reusing what an earlier
generation left there where the caller allows it (Engine(prompt_cache=True): a prompt that starts as the last one
did, such as a chat's system prompt or a conversation's earlier turns, reads only what is new)."""

from __future__ import annotations

import time
from contextlib import contextmanager

from .backends import LM
from .drafters import Drafter
from .errors import ContextExceeded, Interrupted
from .sampling import argmax
from .stats import Stats

RESERVE_AHEAD = 1024  # output tokens sized for up front where the budget runs to the context's end (text_budget)
PREFILL_CHUNK = 512  # tokens per pass of a prompt read on torch where it may be interrupted (llama.cpp: its n_batch)


class Interrupt:
    """Whether a generation must end now: `check` (set through its TextStream by a server: the client gone, the
    deadline passed), asked between the passes of the prompt's read too."""

    def __init__(self):
        self.check = None

    def __call__(self) -> bool:
        return self.check is not None and bool(self.check())


def text_budget(target: LM, prompt_tokens: int, max_new_tokens: int, exact: bool = False) -> int:
    """Tokens of text a generation's caches are sized for before its prompt is read: the prompt and max_new_tokens,
    so that no context is made anew (its text moved or read again) in the middle of a generation. A budget that
    reaches the context's end bounds nothing (a server's request without max_tokens): the prompt and RESERVE_AHEAD
    then, more as the text grows (LM.forward), so that an answer that ends early never held the whole context.
    Exact mode: always all of it (a context made anew reads the text again, in plain decoding's passes)."""
    total = prompt_tokens + max_new_tokens
    if exact or total < target.max_length:
        return min(total, target.max_length)
    return prompt_tokens + RESERVE_AHEAD


@contextmanager
def interruptible(models: list[LM], interrupt: Interrupt | None):
    """While a generation runs, its interrupt is asked between the passes of any re-read of these models' caches
    (LlamaLM.reserve, where a context is made anew); afterwards none is (an ended request's may still say stop)."""
    for lm in models:
        lm.interrupt = interrupt
    try:
        yield
    finally:
        for lm in models:
            lm.interrupt = None


def prefill(
    target: LM,
    drafter: Drafter | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    stats: Stats,
    whole: bool,
    scope: str | None = None,
    interrupt: Interrupt | None = None,
    exact: bool = False,
) -> tuple[list[int], list[int]]:
    """Both caches emptied, then given the prompt but its last token (it goes into the first target pass). With
    `whole` (greedy) the target reads it all: (ids, head), head the argmax of its last row, as llama-cpp-python's
    and HF's generation get it (ours then shares every rounding of the prompt with theirs); else head = [].
    scope: where not None, the target keeps what it holds of the prompt's start if the last generation on it had
    the same scope (LM.keep_prefix); the draft reads the text anew (lazily, where its drafter does). interrupt: asked
    between the prompt's passes (exact mode: those plain decoding reads in); Interrupted when it says to stop."""
    if len(prompt_ids) >= target.max_length:
        raise ContextExceeded(
            f"the prompt has {len(prompt_ids)} tokens; the model's context holds "
            f"{target.max_length}, so no token can be generated",
            param="prompt",
        )
    keep = target.keep_prefix(prompt_ids, scope)  # 0: the cache emptied
    target.owner = None  # until the prompt is in: a failed read leaves nothing to reuse
    stats.cached_prompt_tokens = keep
    target.reserve(text_budget(target, len(prompt_ids), max_new_tokens, getattr(target, "exact", False)))
    if drafter is not None:
        drafter.reset()
    ids, head, t = list(prompt_ids), [], time.perf_counter()
    with target.reading_prompt():
        if whole:
            head = [argmax(_read(target, ids[keep:], interrupt, exact)[-1])]
            ids += head
        elif len(ids) - 1 > keep:
            _read(target, ids[keep:-1], interrupt, exact)
    target.mark_prompt()  # what the prompt's read put in the cache (LlamaLM.reserve reads it so again)
    if interrupt is not None and interrupt():
        raise Interrupted
    if drafter is not None and len(ids) > 1:
        drafter.prefill(ids[:-1])
    target.owner = scope
    stats.prefill_s += time.perf_counter() - t
    return ids, head


def _read(target: LM, ids: list[int], interrupt: Interrupt | None, exact: bool):
    """ids into the target's cache; logits [1, V] after the last. Where an interrupt may be asked, in the passes the
    target reads in anyway (llama.cpp: feed_step, n_batch; torch: PREFILL_CHUNK, but one call in exact mode, as
    plain decoding reads), asking it between them."""
    step = getattr(target, "feed_step", None)
    if interrupt is None or interrupt.check is None or (step is None and exact):
        return target.forward(ids, last_only=True)
    a = 0
    while True:
        n = step(len(ids) - a) if step is not None else min(len(ids) - a, PREFILL_CHUNK)
        logits = target.forward(ids[a : a + n], last_only=True)
        a += n
        if a >= len(ids):
            return logits
        if interrupt():
            raise Interrupted


@contextmanager
def cache_kept_for_reuse(target: LM):
    """Around a generation whose text the target's cache keeps for the next one of its scope (prefill sets the owner):
    the target is released at the end; after an error the cache is left to nobody (after an error inside a pass its
    bookkeeping may not be what the cache holds)."""
    try:
        yield
    except GeneratorExit:  # closed between steps (a client gone): the cache is as the bookkeeping says
        raise
    except BaseException:  # an error, or an interrupt that may have come inside a rollback
        target.owner = None
        raise
    finally:
        target.release()
