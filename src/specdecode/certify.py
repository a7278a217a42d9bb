"""`specdecode certify`: a certificate, for the user's own model pair on their own machine, that
speculative decoding here does not change what the target generates.

Three checks, each with its tolerance stated in the report:
1. KV rollback (target and draft, on the engine's own contexts): after a chain rollback and after a
   tree pass cut to one branch, the next-token logits equal, bit for bit on llama.cpp, those of a fresh
   cache given the same committed text in the same cells, in a pass of the same size (LM.place_chain:
   filler tokens that no text token sees take the rejected nodes' cells and are dropped). Kernels chosen
   by pass size and sums taken in cache order then cancel out, and what is left is the bookkeeping: a
   wrong token, position or visibility kept changes the bits. Reported apart: the cell layout's own
   effect (the same text in contiguous cells) and the pass sizes' (against a plain one-pass prefill).
2. The verifier on the real models' rows: for a few prompts and each sampling setting, p (target)
   and q (draft) at the next position; `verify` draws >= 10^6 first tokens (draft x ~ q, accept with
   min(1, p/q), else the residual), vectorised (no forward pass per draw), and a chi-square test
   against p must not reject at p <= 1e-6. A negative control on the same rows (accept every draft
   token: the output then follows q) shows the test has the power to see a wrong rule.
3. Greedy agreement: every method's greedy output against plain decoding; a divergence passes only
   where the plain run's top-2 logits nearly tie (a margin below the stated bound, which is the
   measured size of kernel rounding differences on that backend and dtype).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from .errors import SpecDecodeError
from .methods import BASELINE
from .sampling import SamplingParams, probs_from_logits, sample
from .verify import verify

PROMPTS = [
    'def binary_search(items, target):\n    """Return the index of target in the sorted list items, or -1."""\n',
    "Explain in three sentences why the sky is blue.",
    "red green blue red green blue red green blue red green",
]
SETTINGS = [SamplingParams(1.0, 50, 1.0), SamplingParams(0.7, 0, 0.9), SamplingParams(1.0, 5, 1.0)]
P_FAIL = 1e-6
MAX_SUPPORT = 4096  # the verifier check runs on the union of p's and q's supports: top-k/top-p keep it small


def tolerances(lm) -> dict:
    """(rollback tolerance, greedy near-tie bound) for an LM: the size of its kernels' rounding
    differences (LM.tolerances: by backend and dtype)."""
    return lm.tolerances()


def _filler(lm) -> int:
    return 1 if lm.vocab_size > 1 else 0


def check_rollback(lm, prompt_ids: list[int], drafted: list[int]) -> list[dict]:
    """Chain and tree rollbacks on one LM, each against the same text written to the same cache cells of a fresh
    cache in a pass of the same size (LM.place_chain): the decision. Reported beside it: the layout's own effect
    (that reference against the text in contiguous cells, same pass sizes) and the pass sizes' (contiguous cells
    against a plain one-pass prefill)."""
    tol = tolerances(lm)["rollback"]
    P = prompt_ids[:-1]
    root = prompt_ids[-1]
    fill = _filler(lm)
    out = []

    def fresh() -> None:
        lm.reset()
        if P:
            lm.forward(P, last_only=True)

    def next_logits() -> torch.Tensor:
        return lm.forward([drafted[0]])[-1]

    def references(committed: list[int], slots: list[int], size: int) -> tuple[torch.Tensor, ...]:
        """(same cells, contiguous cells in a pass of the same size, plain prefill): the next token's logits."""
        fresh()
        lm.place_chain(committed, slots, size, fill)
        same = next_logits()
        fresh()
        lm.forward(committed + [fill] * (size - len(committed)))  # fillers after the text: causal attention
        lm.rollback(len(P) + len(committed))  # keeps them off it
        contiguous = next_logits()
        lm.reset()
        plain = lm.forward(P + committed + [drafted[0]], last_only=True)[-1]
        return same, contiguous, plain

    # chain: one pass of root + 4 drafted tokens, keep root + 2 of them
    k = min(4, len(drafted))
    fresh()
    lm.forward([root] + drafted[:k])
    lm.rollback(len(P) + 3)
    got = next_logits()
    committed = [root] + drafted[:2]
    out.append(_compare("chain rollback", got, *references(committed, [0, 1, 2], k + 1), tol))

    # tree: root with children a, b; a with children c, d; d with child e (a pass of 6 tokens); keep a, d, e
    t = (drafted * 3)[:5]
    parents_local = [-1, -1, 0, 0, 3]
    fresh()
    base = len(lm)
    lm.forward([root] + t, parents=[base - 1] + [base + 1 + p for p in parents_local])
    branch = [0, 3, 4]
    lm.rollback(base + 1, [base + 1 + j for j in branch])
    got = next_logits()
    committed = [root] + [t[j] for j in branch]
    out.append(
        _compare("tree branch rollback", got, *references(committed, [0] + [1 + j for j in branch], len(t) + 1), tol)
    )
    lm.reset()
    return out


def _compare(name, got, same, contiguous, plain, tol) -> dict:
    """Pass if got is within tol of the same-cells reference (0 on llama.cpp: bit for bit). A kept entry with
    the wrong token, position or visibility changes its keys and values, so got then differs from a reference
    that computes the same sums in the same order. The two rounding effects are reported apart: where the kept
    branch's cells sit (a tree rollback leaves holes, and the next token takes the first: attention sums cells
    in cache order; on quantized llama.cpp models that moves a logit by up to ~0.4), and the pass sizes."""
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731
    d = diff(got, same)
    return {
        "check": name,
        "max_abs_diff": d,
        "tolerance": tol,
        "passed": d <= tol,
        "bit_identical": torch.equal(got, same),
        "layout_effect": diff(same, contiguous),
        "pass_size_noise": diff(contiguous, plain),
        "max_abs_diff_vs_plain_prefill": diff(got, plain),
    }


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square p-value of counts against probs; categories expected < 5 times are pooled."""
    from scipy.stats import chi2

    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp[-1] < 5:  # too little pooled mass for its own bin: fold it into the last big one
        obs = torch.cat([obs[:-2], (obs[-2] + obs[-1]).reshape(1)])
        exp = torch.cat([exp[:-2], (exp[-2] + exp[-1]).reshape(1)])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-300)).sum())
    dof = len(exp) - 1
    return (float(chi2.sf(stat, dof)) if dof > 0 else 1.0), dof


def check_verifier(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator) -> dict:
    """draws first tokens through `verify` (gamma 1) on rows p, q [V]; chi-square against p, and the
    accept-everything control (which follows q) on the same draws."""
    support = torch.nonzero((p > 0) | (q > 0)).flatten()
    if len(support) > MAX_SUPPORT:
        raise SpecDecodeError(f"the verifier check needs a bounded support (top-k or top-p): {len(support)} tokens")
    ps, qs = p[support].float(), q[support].float()
    counts = torch.zeros(len(support), dtype=torch.long)
    control = torch.zeros(len(support), dtype=torch.long)
    chunk = max(1, min(draws, (1 << 22) // len(support)))  # ~16 MB per [chunk, support] tensor
    done = 0
    while done < draws:
        b = min(chunk, draws - done)
        x = sample(qs.expand(b, -1), generator)  # [b] draft tokens drawn from q
        P = ps.expand(b, 2, -1)  # position 0: the token after the prompt; 1: the bonus
        accepted, nxt = verify(P, qs.expand(b, 1, -1), x[:, None], generator)
        first = torch.where(accepted > 0, x, nxt)
        counts += torch.bincount(first, minlength=len(support))
        control += torch.bincount(x, minlength=len(support))
        done += b
    p_value, dof = chi_square(counts, ps / ps.sum())
    p_control, _ = chi_square(control, ps / ps.sum())
    tv = 0.5 * float((ps / ps.sum() - qs / qs.sum()).abs().sum())
    return {
        "draws": draws,
        "support": len(support),
        "dof": dof,
        "p_value": p_value,
        "passed": p_value > P_FAIL,
        "control_p_value": p_control,
        "control_informative": p_control <= P_FAIL,
        "tv_distance_p_q": tv,
    }


class RowRecorder:
    """Wraps an LM and keeps a digest of every logits row it computes, by the text the row follows (the
    committed text, then the row's tree branch): the rows a generation's verifier read can then be
    compared bit for bit with plain decoding's. Everything else goes to the LM."""

    def __init__(self, lm):
        self._lm, self.rows = lm, {}
        self._ctx: list[tuple[int, ...]] = []  # per cache entry: the text up to and including it

    def __getattr__(self, name):
        return getattr(self._lm, name)

    @property
    def pad_rows(self) -> int:  # set by exact mode's padding (exactness.padding): the LM's own
        return self._lm.pad_rows

    @pad_rows.setter
    def pad_rows(self, rows: int) -> None:
        self._lm.pad_rows = rows

    def __len__(self) -> int:
        return len(self._lm)

    def reset(self) -> None:
        self._lm.reset()
        self._ctx = []

    def forward(self, new_ids, last_only=False, parents=None):
        start = len(self._ctx)
        out = self._lm.forward(new_ids, last_only=last_only, parents=parents)
        parents = list(range(start - 1, start - 1 + len(new_ids))) if parents is None else parents
        for tok, par in zip(new_ids, parents):
            self._ctx.append((self._ctx[par] if par >= 0 else ()) + (tok,))
        first = len(new_ids) - out.shape[0]  # last_only: the last row
        for j in range(out.shape[0]):
            self.rows[self._ctx[start + first + j]] = hashlib.sha1(out[j].contiguous().numpy().tobytes()).hexdigest()
        return out

    def rollback(self, length: int, path=()) -> None:
        self._lm.rollback(length, path)
        self._ctx = self._ctx[:length] + [self._ctx[i] for i in path]


def _recorded(engine, prompt: str, method: str, max_new_tokens: int):
    """(generation, {text: row digest}) of one greedy generation."""
    target, engine.target = engine.target, RowRecorder(engine.target)
    try:
        out = engine.generate(prompt, method=method, max_new_tokens=max_new_tokens, temperature=0.0)
        return out, engine.target.rows
    finally:
        engine.target = target


def check_greedy(
    engine, prompt: str, method: str, max_new_tokens: int, plain_ids: list[int], plain_rows: dict | None = None
) -> dict:
    """A method's greedy output against plain decoding's: token for token, and (with plain_rows) the
    logits rows its verifier read at each position against plain decoding's, bit for bit. In exact mode
    (engine.exact) any difference fails; otherwise a divergence passes only at a near-tie."""
    out, rows = _recorded(engine, prompt, method, max_new_tokens)
    ids = out.token_ids
    res = {
        "method": method,
        "tokens": len(ids),
        "identical": ids == plain_ids,
        "divergence": None,
        "passed": True,
        "drafted": out.stats.drafted,
        "accepted": out.stats.accepted,
        "exact_mode": engine.exact,
    }
    prompt_ids = tuple(engine.encode(prompt))
    if plain_rows is not None:  # positions both runs reached with the same text
        same = n = 0
        for i in range(min(len(ids), len(plain_ids)) + 1):
            text = prompt_ids + tuple(plain_ids[:i])
            if i and ids[i - 1] != plain_ids[i - 1]:
                break
            if text in rows and text in plain_rows:
                n += 1
                same += rows[text] == plain_rows[text]
        res.update(positions_compared=n, bit_identical=same, bit_identical_fraction=same / n if n else None)
        if engine.exact and same != n:
            res["passed"] = False
    if ids == plain_ids:
        return res
    i = next((k for k, (a, b) in enumerate(zip(plain_ids, ids)) if a != b), min(len(ids), len(plain_ids)))
    tie = tolerances(engine.target)["tie"]
    engine.target.reset()
    logits = engine.target.forward(list(prompt_ids) + plain_ids[:i], last_only=True)[-1]
    engine.target.reset()
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    took = ids[i] if i < len(ids) else None
    runner_up = int(top.indices[1])
    ok = (
        not engine.exact
        and i < len(ids)
        and i < len(plain_ids)
        and margin <= tie
        and took in (runner_up, int(top.indices[0]))
    )
    res.update(
        divergence={"at": i, "top2_margin": margin, "bound": tie, "took_runner_up": took == runner_up},
        passed=bool(ok) and res["passed"],
    )
    return res


def certify(
    engine,
    *,
    methods: list[str],
    prompts: list[str] | None = None,
    settings: list[SamplingParams] | None = None,
    draws: int = 10**6,
    max_new_tokens: int = 48,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    from tqdm.auto import tqdm

    prompts = prompts or PROMPTS
    settings = settings or SETTINGS
    generator = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    lms = [("target", engine.target)] + ([("draft", engine.draft_model.lm)] if engine.draft_model else [])
    steps = len(lms) + len(prompts) * (len(settings) + len(methods) + 1)
    bar = tqdm(total=steps, desc="certify", disable=not progress)
    report = {
        "backend": engine.backend,
        "target": engine.target.name,
        "draft": engine.draft_model.lm.name if engine.draft_model else None,
        "tolerances": {name: tolerances(lm) for name, lm in lms},
        "p_fail": P_FAIL,
        "rollback": [],
        "verifier": [],
        "greedy": [],
    }
    probe = engine.encode(prompts[0])
    drafted = engine.target.forward(probe, last_only=True)[-1].topk(5).indices.tolist()
    for name, lm in lms:  # the engine's own contexts: what its generations run on
        for r in check_rollback(lm, probe, drafted):
            report["rollback"].append({"model": name, **r})
        bar.update(1)
    for prompt in prompts:
        ids = engine.encode(prompt)
        engine.target.reset()
        p_logits = engine.target.forward(ids, last_only=True)[-1]
        engine.target.reset()
        q_logits = None
        if engine.draft_model is not None:
            engine.draft_model.lm.reset()
            from .drafters import fit_vocab

            q_logits = fit_vocab(engine.draft_model.lm.forward(ids, last_only=True)[-1], engine.vocab_size)
            engine.draft_model.lm.reset()
        for params in settings:
            p = probs_from_logits(p_logits, params)
            # no draft model: a deterministic drafter proposes the target's own argmax (a one-hot q)
            q = (
                probs_from_logits(q_logits, params)
                if q_logits is not None
                else torch.zeros_like(p).index_fill_(0, p_logits.argmax().reshape(1), 1.0)
            )
            r = check_verifier(p, q, draws, generator)
            report["verifier"].append(
                {
                    "prompt": prompt[:40],
                    "temperature": params.temperature,
                    "top_k": params.top_k,
                    "top_p": params.top_p,
                    **r,
                }
            )
            bar.update(1)
        plain_out, plain_rows = _recorded(engine, prompt, BASELINE, max_new_tokens)
        plain = plain_out.token_ids
        bar.update(1)
        for m in methods:
            report["greedy"].append(
                {"prompt": prompt[:40], **check_greedy(engine, prompt, m, max_new_tokens, plain, plain_rows)}
            )
            bar.update(1)
    bar.close()
    report["passed"] = all(r["passed"] for part in ("rollback", "verifier", "greedy") for r in report[part])
    report["wall_s"] = time.perf_counter() - t0
    return report


def markdown(report: dict) -> str:
    ok = lambda b: "pass" if b else "**FAIL**"  # noqa: E731
    lines = [
        f"# specdecode certificate: {'PASSED' if report['passed'] else 'FAILED'}\n",
        f"Backend {report['backend']}, target {report['target']}, draft {report['draft'] or '–'}; "
        f"{report.get('cpu', '')} ({report['wall_s']:.0f} s)\n",
        "## 1. KV rollback\n",
        "Next-token logits after the rollback vs a fresh cache given the same text in the same cells, in a "
        "pass of the same size (the decision: within the tolerance, 0 = bit for bit). For information: "
        "the cell layout's own effect (the same text in contiguous cells; a tree rollback leaves holes "
        "that the next token fills) and the pass sizes' (contiguous cells vs a plain one-pass prefill).\n",
        "| model | check | max abs diff (same cells) | tolerance | layout effect | pass-size noise | "
        "vs plain prefill | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rollback"]:
        lines.append(
            f"| {r['model']} | {r['check']} | {r['max_abs_diff']:.2e} | {r['tolerance']:g} | "
            f"{r['layout_effect']:.2e} | {r['pass_size_noise']:.2e} | "
            f"{r['max_abs_diff_vs_plain_prefill']:.2e} | {ok(r['passed'])} |"
        )
    lines += [
        "\n## 2. Verifier on the real models' rows\n",
        f"First tokens drawn through `verify` (draft x ~ q, accepted with min(1, p/q), else the residual) vs "
        f"the target's p; chi-square, failing at p ≤ {report['p_fail']:g}. Control: accepting every draft token "
        "(the output then follows q) on the same draws — it must be rejected when p and q differ enough.\n",
        "| prompt | T | top-k | top-p | draws | support | TV(p, q) | p-value | control p-value | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["verifier"]:
        lines.append(
            f"| {r['prompt']!r} | {r['temperature']} | {r['top_k']} | {r['top_p']} | {r['draws']:,} | "
            f"{r['support']} | {r['tv_distance_p_q']:.3f} | {r['p_value']:.3g} | {r['control_p_value']:.3g} | "
            f"{ok(r['passed'])} |"
        )
    exact = any(r.get("exact_mode") for r in report["greedy"])
    lines += [
        "\n## 3. Greedy agreement with plain decoding\n",
        (
            "Exact mode: every logits row the verifier read must be bit-identical to plain decoding's at the same "
            "position, and the output identical.\n"
            if exact
            else "A divergence passes only at a near-tie of plain decoding's top two logits (the bound: this backend's "
            "rounding). Bit-identical: the positions whose logits row equals plain decoding's in every bit.\n"
        ),
        "| prompt | method | tokens | drafted / accepted | identical | bit-identical rows | first divergence "
        "(top-2 margin / bound) | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["greedy"]:
        d = r["divergence"]
        div = "–" if d is None else f"token {d['at']}: {d['top2_margin']:.3f} / {d['bound']}"
        bits = f"{r['bit_identical']}/{r['positions_compared']}" if "bit_identical" in r else "–"
        lines.append(
            f"| {r['prompt']!r} | {r['method']} | {r['tokens']} | {r['drafted']} / {r['accepted']} | "
            f"{'yes' if r['identical'] else 'no'} | {bits} | {div} | {ok(r['passed'])} |"
        )
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "certificate.json").write_text(json.dumps(report, indent=1))
    (out / "certificate.md").write_text(markdown(report))
    return out
