"""The draft model: a small causal LM with the target's tokenizer and its own KV cache. As a drafter it
proposes a chain of gamma tokens; the tree drafter (tree.TreeDrafter) grows trees with its root and expand
passes. It sees a window of the text (DRAFT_WINDOW), and its output layer may be truncated (FR-Spec).
"""

from __future__ import annotations

import torch

from ..backends import as_lm
from ..errors import SpecDecodeError
from ..sampling import SamplingParams, argmax, probs_from_logits, sample
from . import DRAFT_WINDOW  # (defined with the package: the command line's default, read without torch)
from .base import Draft, fit_vocab

CATCHUP_APART = 16  # a root pass feeding more tokens than this reads them first in a pass of their own (timed)


class DraftModel:
    """A small causal LM that shares the target's tokenizer, with its own KV cache. As a drafter it
    proposes a chain of gamma tokens; tree.TreeDrafter grows trees with its root and expand passes.
    Cache invariant: the draft cache holds a prefix of the committed ids (all of them after a root pass)."""

    def __init__(self, model, vocab_size: int, window: int | None = DRAFT_WINDOW):
        self.lm = as_lm(model)  # an HF model (wrapped as a CachedLM) or an LM such as a LlamaLM
        self.vocab_size = vocab_size  # the target's V: q must live on the same support as p
        self.keep: torch.Tensor | None = None  # the token ids the output layer still has (None: all)
        # the draft sees only the last `window` tokens or so (None: all of them): ids[offset:] at positions
        # 0, 1, ... of its own cache. The target decides every token, so what the draft sees is free to choose;
        # on a long prompt it then reads a window instead of the whole prompt.
        self.window = window
        self.offset = 0
        self.budget: int | None = None  # tokens of text the running generation may reach (reserve); None: unknown

    def truncate(self, keep) -> None:
        """FR-Spec (Zhao et al. 2025): keep only these rows of the draft's output layer (the most
        frequent tokens), which is a large share of a small model's forward (151,936 x 896 of the
        0.5B's 494M weights). The draft then never proposes another token: q is zero there, which the
        verifier handles as any q (lossless); only the acceptance of rare tokens is lost."""
        error = self.lm.output_truncation_error()
        if error:
            raise SpecDecodeError(error)
        if self.keep is not None:
            raise SpecDecodeError("the draft's output layer is truncated already")
        keep = torch.as_tensor(sorted({int(i) for i in keep}), dtype=torch.long)
        rows = min(self.lm.vocab_size, self.vocab_size)
        if not len(keep) or keep[0] < 0 or keep[-1] >= rows:
            raise SpecDecodeError(f"draft vocabulary ids must lie in 0..{rows - 1}")
        self.lm.truncate_output(keep)
        self.keep = keep

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (-inf where the draft has no output row)."""
        if self.keep is None:
            return fit_vocab(logits, self.vocab_size)
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.keep] = logits
        return out

    def reset(self) -> None:
        self.lm.reset()
        self.offset = 0

    def reserve(self, n: int) -> None:
        """Empty the draft's cache and size it for a text of n tokens: the view of it the draft sees (at most 1.5
        windows; a draft's depth fits in the room LM.reserve keeps beyond the text)."""
        self.reset()
        self.budget = n
        w = self.view_window
        self.lm.reserve(n if w is None else min(n, w + w // 2))

    def _rebase(self, n: int) -> int:
        """The offset the draft's view starts at once n committed tokens stand: kept while the view is
        under 1.5 windows long (so the draft re-reads a window only every half window of text), else
        moved to n - window with the cache emptied."""
        w = self.view_window
        if w is None:
            return self.offset
        offset = self.offset if n - self.offset <= w + w // 2 else max(0, n - w)
        return self._late_start(offset, n) if not len(self.lm) else offset

    def _late_start(self, offset: int, n: int) -> int:
        """Where a view that begins now (nothing read yet, n tokens committed) starts instead of at `offset`: late
        enough that the generation's whole text (its budget) stays within 1.5 windows, so that the draft never reads
        a window again mid-generation, while at least half a window of the text so far stays in view."""
        w, budget = self.view_window, self.budget
        if w is None or budget is None or budget - offset <= w + w // 2:
            return offset
        return max(offset, min(budget - w - w // 2, n - w // 2))

    @property
    def view_window(self) -> int | None:
        """The window in force: at most half the draft's own context, so that a view of 1.5 windows and
        a draft's depth always fit in it (a short-context draft then never runs out of room)."""
        return None if self.window is None else max(1, min(self.window, self.lm.max_length // 2))

    def unread(self, n: int) -> int:
        """Tokens the draft must read (the last one included) before it guesses after n committed tokens:
        what the root pass feeds. Its cost is the catch-up a planner weighs before running the draft."""
        offset = self._rebase(n)
        return n - offset - (len(self.lm) if offset == self.offset else 0)

    def seen(self, n: int) -> int:
        """Tokens in the draft's view once it has caught up with n committed tokens (its context length)."""
        return n - self._rebase(n)

    def room(self, n: int) -> int:
        """How deep a draft may grow after n committed tokens without leaving the draft model's own
        context (positions 0 .. lm.max_length-1): the root pass reads up to view position n-1, and a node
        at depth d is fed (to get the logits of depth d+1) at view position n-1+d; the deepest nodes are
        never fed. 0 = the draft model can no longer draft: the target goes on without it."""
        return max(0, self.lm.max_length - self.seen(n) + 1)

    def prefill(self, ids: list[int]) -> None:
        if self.room(len(ids) + 1):  # a prompt longer than the draft's context: it never drafts
            w = self.view_window
            self.offset = self._late_start(max(0, len(ids) - w), len(ids)) if w is not None else 0
            self.lm.reset()
            self.lm.forward(ids[self.offset :], last_only=True)

    def root(self, ids: list[int], read=None) -> tuple[torch.Tensor, int]:
        """Logits [V] of the token after ids, and how many tokens this pass fed. Cache invariant:
        lm.ids is a prefix of ids[offset:] (commit keeps it so); feed what it lacks. read(tokens): called
        first with the tokens to catch up on (all fed but the last), when there are more than a few, so
        that a caller can time that part apart."""
        offset = self._rebase(len(ids))
        if offset != self.offset:
            self.offset = offset
            self.lm.reset()
        pending = ids[self.offset + len(self.lm) :]
        if read is not None and len(pending) > CATCHUP_APART:
            read(lambda: self.lm.forward(pending[:-1], last_only=True))
            return self._full(self.lm.forward(pending[-1:], last_only=True)[-1]), len(pending)
        return self._full(self.lm.forward(pending, last_only=True)[-1]), len(pending)

    def keep_branch(self, length: int, branch: list[int]) -> None:
        """ids[:length] and then the draft-cache entries `branch` (accepted tree nodes that went through a
        draft pass, hanging off the last cached entry) now stand."""
        n = length - self.offset
        self.lm.rollback(min(n, len(self.lm)), branch if len(self.lm) >= n else [])

    def expand(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """One pass over tree nodes (parents: draft-cache indices); logits [k, V] after each."""
        return self._full(self.lm.forward(tokens, parents=parents))

    def propose(self, ids: list[int], gamma: int, params: SamplingParams, generator=None) -> Draft:
        """A chain: gamma draft passes, each token drawn from the draft's q (greedy: its argmax)."""
        gamma = min(gamma, self.room(len(ids)))
        if gamma <= 0:  # the draft's context is full: a plain step
            return Draft([], None)
        logits, _ = self.root(ids)
        tokens, qs = [], []
        for i in range(gamma):
            if params.greedy:  # a one-hot q: the argmax, no [V] row built
                tokens.append(int(argmax(logits)))
            else:
                qs.append(probs_from_logits(logits, params))
                tokens.append(int(sample(qs[-1], generator)))
            if i + 1 < gamma:  # the last token is fed with the next step's root pass, if accepted
                logits = self._full(self.lm.forward(tokens[-1:], last_only=True)[-1])
        q = None if params.greedy else torch.stack(qs)  # greedy: one-hot q
        return Draft(tokens, q, strategy="draft", sources=["draft"] * len(tokens))

    def commit(self, length: int, path: list[int], bonus: int) -> None:
        """Keep ids[:length] and the accepted draft tokens the cache holds (the next root feeds the rest)."""
        self.lm.rollback(min(length + len(path) - self.offset, len(self.lm)))


def check_compatible(target_tok, draft_tok) -> None:
    """Speculation needs one token space: the same id must mean the same string in both models."""
    if target_tok is draft_tok:
        return
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise SpecDecodeError(
            f"draft and target tokenizers differ ({len(dv)} vs {len(tv)} tokens, "
            f"{diff} entries disagree); speculative decoding needs the same vocabulary"
        )
