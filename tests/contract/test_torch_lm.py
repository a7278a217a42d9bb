"""What only the torch backend (CachedLM) has to say beyond the LM contract: a sliding-window model refuses token
trees (its window could hide a node's own ancestors) while chains keep working and rolling back.

Tree passes, the tree attention mask, per-token positions and branch compaction run on both backends in
test_lm_contract.py (reference for every check: a fresh CachedLM that prefills the same text as a plain chain).
"""

import pytest
import torch

from specdecode.backends import CachedLM
from specdecode.errors import SpecDecodeError
from tiny import tiny_sliding_model

TOL = dict(rtol=1e-4, atol=1e-4)
ROOT = 61


def chain_logits(model, ids):
    """Last-position logits of a fresh plain-chain prefill of ids."""
    return CachedLM(model).forward(list(ids), last_only=True)[-1]


def test_sliding_window_model_refuses_trees_but_chains_work():
    model = tiny_sliding_model()
    lm = CachedLM(model)
    text = list(range(30, 60))  # 30 tokens: past the window of 16
    lm.forward(text[:20])
    with pytest.raises(SpecDecodeError, match="sliding"):
        lm.forward([ROOT, 11, 12], parents=[19, 20, 20])
    assert lm.ids == text[:20]
    lm.forward(text[20:])  # chain forward still works after the refusal
    lm.rollback(12)
    assert lm.ids == text[:12]
    torch.testing.assert_close(lm.forward([77])[-1], chain_logits(model, text[:12] + [77]), **TOL)
    lm.rollback(5)
    torch.testing.assert_close(lm.forward([78, 79])[-1], chain_logits(model, text[:5] + [78, 79]), **TOL)
