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


def cut_by_stop(rest: str, pieces: list[str], stops: list[str]) -> list[int]:
    """The tokens a stop-cut answer's last token may have been: the server cuts the text before the stop string,
    so the token it sampled may have held more than the text shows (`:\\n\\n` shown as `:` under the stop `\\n`).
    pieces: each token id's text. A candidate's text is rest followed by a beginning of a stop string, or by a stop
    string and more."""
    out = []
    for t, piece in enumerate(pieces):
        if piece.startswith(rest):
            tail = piece[len(rest) :]
            if any(tail.startswith(s) or s.startswith(tail) for s in stops):
                out.append(t)
    return out


def score_partings(pairs: list[dict], target: str, threads: int | None = None) -> dict[str, dict]:
    """pairs: {"i": record index, "body": the request, "alone": text, "under_load": text, and optionally
    "alone_finish" / "under_load_finish": the finish reasons}. Returns per index the logit gap at the first token
    the two answers part on, scored by the target alone, and the tie tolerance. Where a side's text was cut by a
    stop string and parts on its last token, that side's token is the best-scored one its text and the stop strings
    allow (cut_by_stop): the text alone does not say which the server sampled."""
    from ..engine import Engine

    engine = Engine.load(target, None, backend="llama.cpp", with_draft=False, progress=False, threads=threads)
    lm, out = engine.target, {}
    tol = lm.tolerances()["tie"]
    pieces: list[str] = []  # each token's text, read once when a stop-cut parting needs it
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
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        cut = tuple(
            bool(stops) and p.get(f"{side}_finish") == "stop" and j == len(ids) - 1
            for side, ids in (("alone", a), ("under_load", b))
        )
        key = (tuple(prompt), tuple(a[: j + 1]), b[j], cut, tuple(stops) if any(cut) else ())
        if key not in scored:
            lm.reset()
            logits = lm.forward(prompt + list(a[:j]), last_only=True).reshape(-1).float()
            lm.reset()
            top = int(logits.argmax())
            if any(cut) and not pieces:
                pieces = engine.tokenizer.batch_decode(
                    [[t] for t in range(int(logits.shape[0]))], skip_special_tokens=True
                )
            tokens = []
            for ids, was_cut in ((a, cut[0]), (b, cut[1])):
                rest = engine.decode(list(ids[j:])) if was_cut else ""
                options = cut_by_stop(rest, pieces, stops) if was_cut else []
                tokens.append(max(options, key=lambda t: float(logits[t])) if options else int(ids[j]))
            if tokens[0] == tokens[1]:  # both texts allow the same token: nothing tells the two apart
                scored[key] = {"gap": None, "tie": tol, "why": "both stop-cut texts allow the same token"}
            else:
                gap = float(logits[tokens[0]] - logits[tokens[1]])
                scored[key] = {
                    "gap": round(gap, 4),
                    "tie": tol,
                    "near_tie": abs(gap) <= tol,
                    "tokens": tokens,
                    "alone_top": top in tokens,
                    **({"stop_cut": list(cut)} if any(cut) else {}),
                }
        out[str(p["i"])] = dict(scored[key])
    return out
