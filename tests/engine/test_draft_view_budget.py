"""The draft model's view of the text (its window) begins where the generation's whole text, as far as its budget
reaches, stays within 1.5 windows: the draft then never empties its cache to read a window again mid-generation,
where the output is at most a window long. Greedy output is the target's either way."""

from __future__ import annotations

import pytest

from helpers import CHEAP
from specdecode import Engine
from tiny import byte_tokenizer, tiny_model

WINDOW = 32
PROMPT = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"  # 66 tokens: over 1.5 windows


def _engine_counting_resets():
    tok = byte_tokenizer()
    engine = Engine(tiny_model(0), tok, tiny_model(0), tok, draft_window=WINDOW)  # the draft = the target: it agrees
    engine.costs = CHEAP
    lm, resets = engine.draft_model.lm, []
    reset = lm.reset
    lm.reset = lambda: (resets.append(len(lm)), reset())[1]
    return engine, resets


@pytest.mark.parametrize("method", ["draft", "tree"])
def test_a_budget_within_a_window_never_reads_the_draft_again(method):
    engine, resets = _engine_counting_resets()
    plain = engine.generate(PROMPT, method="autoregressive", max_new_tokens=WINDOW)
    resets.clear()
    out = engine.generate(PROMPT, method=method, max_new_tokens=WINDOW)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == WINDOW
    assert out.stats.strategies.get("draft", 0) + out.stats.strategies.get("tree", 0) > 0
    assert all(n == 0 for n in resets)  # emptied only before anything was read (never a read text dropped)
    view = len(PROMPT) + WINDOW - engine.draft_model.offset
    assert WINDOW // 2 <= len(PROMPT) - engine.draft_model.offset and view <= WINDOW + WINDOW // 2


def test_a_longer_output_still_moves_the_view():
    """Control: an output over a window long cannot stay in view with half a window of the prompt; the view moves
    on (the draft reads a window again) and stays within 1.5 windows plus a draft."""
    engine, resets = _engine_counting_resets()
    plain = engine.generate(PROMPT, method="autoregressive", max_new_tokens=3 * WINDOW)
    resets.clear()
    out = engine.generate(PROMPT, method="draft", max_new_tokens=3 * WINDOW)
    assert out.token_ids == plain.token_ids
    assert any(n > 0 for n in resets) and len(engine.draft_model.lm) <= WINDOW + WINDOW // 2 + 8
