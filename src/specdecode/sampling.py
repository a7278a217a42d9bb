"""One transform from logits to probabilities, shared by target and draft.

Speculative sampling is lossless only if p (target) and q (draft) are the distributions the
two models would actually sample from, so temperature, top-k and top-p are applied to both by
this one function. Greedy decoding is its own path: argmax as a one-hot distribution, which the
verifier treats like any other p (accept iff the draft token is the argmax).
"""

from __future__ import annotations

import math

import torch

from .params import SamplingParams  # noqa: F401  (the settings, torch-free: the CLI checks them before torch loads)


def argmax(logits: torch.Tensor):
    """`logits.argmax(-1).tolist()`: an int for one row [V], a list for rows [..., V]; the first index on ties and
    NaN counted as the largest, as torch's. On a CPU float32 tensor (llama.cpp's logits) numpy's, which takes
    ~10 us on a 151,936-token vocabulary where torch's takes ~130: this runs on every greedy step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32 (one-hot argmax when greedy)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # shift first, and keep T representable in float32: a tiny temperature must give the argmax, not nan
    logits = logits - logits.amax(-1, keepdim=True)
    if params.temperature != 1:  # x / 1.0 is x, bit for bit: skip the op at T=1
        logits = logits / max(params.temperature, 1e-30)
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= max(params.top_p, 1e-30)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., V] (unnormalised is fine) -> token ids [...], by inverting the float64 CDF with one
    uniform draw per row: exact up to float64 rounding, never a zero-probability token, and much
    faster than torch.multinomial on a 150k vocabulary (measured: docs/results/notes.md#code-sampling)."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (cast first, then summed: in float64)
    u = torch.rand(*cdf.shape[:-1], 1, generator=generator, dtype=torch.float64, device=cdf.device) * cdf[..., -1:]
    # the first index whose CDF exceeds u: a token with p = 0 repeats its predecessor's CDF, so never
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)[..., 0]
