"""Near-ties: is a greedy answer that differs under load from the same request alone a numerical near-tie?

llama.cpp's passes over several generations at once (`serve --parallel`) round otherwise than a pass over one, so
greedy answers can part where the top two logits are nearly equal (llama-server's answers do as well:
docs/serving/batching.md). For each such answer the target alone, in one context of its own, reads the request's
prompt and the text both answers share, and scores the two tokens they part on: within the target's tie tolerance
(`LM.tolerances()["tie"]`) it is a near-tie, past it a real difference that a criterion must fail on.
"""
from __future__ import annotations


def first_tokens_apart(a: list[int], b: list[int]) -> int | None:
    """The first index where token lists a and b differ (None: one is a prefix of the other)."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None


def score_partings(pairs: list[dict], target: str, threads: int | None = None) -> dict[str, dict]:
    """pairs: {"i": record index, "body": the request, "alone": text, "under_load": text}. Returns per index the
    logit gap at the first token the two answers part on, scored by the target alone, and the tie tolerance."""
    from ..engine import Engine
    engine = Engine.load(target, None, backend="llama.cpp", with_draft=False, progress=False, threads=threads)
    lm, out = engine.target, {}
    tol = lm.tolerances()["tie"]
    scored: dict[tuple, dict] = {}  # the same prompt parting the same way (a built-in prompt sent again): one pass
    for p in pairs:
        body = p["body"]
        chat = "messages" in body
        prompt = engine.encode(body["messages"] if chat else body["prompt"], chat)
        a, b = engine.encode_prediction(p["alone"]) or (), engine.encode_prediction(p["under_load"]) or ()
        j = first_tokens_apart(list(a), list(b))
        if j is None or len(prompt) + j >= lm.max_length:
            out[str(p["i"])] = {"gap": None, "tie": tol, "why": "the texts do not part on a token"}
            continue
        key = (tuple(prompt), tuple(a[:j + 1]), b[j])
        if key not in scored:
            lm.reset()
            logits = lm.forward(prompt + list(a[:j]), last_only=True).reshape(-1).float()
            lm.reset()
            top = int(logits.argmax())
            gap = float(logits[a[j]] - logits[b[j]])
            scored[key] = {"gap": round(gap, 4), "tie": tol, "near_tie": abs(gap) <= tol,
                           "tokens": [int(a[j]), int(b[j])], "alone_top": top in (a[j], b[j])}
        out[str(p["i"])] = dict(scored[key])
    return out
