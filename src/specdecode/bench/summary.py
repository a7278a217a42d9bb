"""A bench run's rows summed up per method (and per category and turn): speeds, speedups against
plain decoding from the same run, acceptance, the cost model's predictions and the analytic bounds."""

from __future__ import annotations

from ..methods import BASELINE
from ..stats import decode_rate  # noqa: F401  (bench.decode_rate, as before)
from .peers import PEERS, has_flag


def analytic_bound(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al. 2023, Theorem 3.8: expected walltime improvement factor."""
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def cost_model_bound(alpha: float, gamma: int, c: float, v: float) -> float:
    """Theorem 3.8 without its premise that a (gamma+1)-token target pass costs what a 1-token pass
    does: expected tokens per pass / (gamma c + v), with v the measured cost of a verify pass in units
    of a plain 1-token pass. Where verification is not free (compute-bound CPUs), this is the ceiling."""
    tokens = gamma + 1 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens / (gamma * c + v)


def alpha_from_counts(accepted: int, rejections: int) -> float | None:
    """Per-token acceptance alpha: a draft token is tested only if all before it were accepted, so
    alpha = accepted / (accepted + rejections) (the geometric-model estimate)."""
    tested = accepted + rejections
    return accepted / tested if tested else None


class _Rows:
    """A run's rows, summed by method (and category): the sums every summary reads."""

    def __init__(self, rows: list[dict], methods: list[str], config: dict):
        self.rows, self.config = rows, config
        # the yardstick of every ratio
        self.peer = "llama.cpp" if "llama.cpp" in methods and self.picked("llama.cpp") else None
        fwd = self.total(BASELINE, "target_forwards")
        self.ar_step = self.total(BASELINE, "verify_s") / fwd if fwd else None  # one plain step, in seconds
        self.ar_ids = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == BASELINE}

    def total(self, m, key, cat=None):
        return sum(
            r[key]
            for r in self.rows
            if r["method"] == m and r[key] is not None and (cat is None or r["category"] == cat)
        )

    def tps(self, m, cat=None):
        wall = self.total(m, "wall_s", cat)
        return self.total(m, "new_tokens", cat) / wall if wall else None

    def picked(self, m, cat=None):
        return [r for r in self.rows if r["method"] == m and (cat is None or r["category"] == cat)]

    def dtps(self, m, cat=None):
        """Decode tok/s: tokens after each run's first / seconds after its first (runs with a TTFT)."""
        timed = [r for r in self.picked(m, cat) if r.get("ttft_s") is not None and r["new_tokens"] >= 1]
        seconds = sum(r["wall_s"] - r["ttft_s"] for r in timed)
        return sum(r["new_tokens"] - (r.get("first_tokens") or 1) for r in timed) / seconds if seconds > 0 else None

    def mean_ttft(self, m, cat=None):
        ttfts = [r["ttft_s"] for r in self.picked(m, cat) if r.get("ttft_s") is not None]
        return sum(ttfts) / len(ttfts) if ttfts else None

    def speeds(self, m, cat=None) -> dict:
        """Overall and decode speed, TTFT and the ratios against autoregressive and the llama.cpp peer."""
        t, d, peer = self.tps(m, cat), self.dtps(m, cat), self.peer
        return {
            "tokens_per_second": t,
            "speedup": _ratio(t, self.tps(BASELINE, cat)),
            "decode_tokens_per_second": d,
            "decode_speedup": _ratio(d, self.dtps(BASELINE, cat)),
            "ttft_s": self.mean_ttft(m, cat),
            "vs_llama_cpp": {"overall": _ratio(t, self.tps(peer, cat)), "decode": _ratio(d, self.dtps(peer, cat))}
            if peer
            else None,
        }

    def predicted(self, m, cat=None):
        """The cost model's speedup over the planned passes: expected tokens / modelled seconds counted in
        plain steps (each run's own plain step where it has one, else the measured 1-token pass)."""
        fallback = (self.config.get("pass_costs") or {}).get("target_s_1")
        expected = steps = 0.0
        for r in self.picked(m, cat):
            plain = r.get("plain_step_s") or fallback
            if r.get("modelled_s") and plain:
                expected += r.get("expected_tokens") or 0.0
                steps += r["modelled_s"] / plain
        return expected / steps if steps else None

    def planned(self, m, cat=None) -> dict:
        """A planned method's expected tokens per pass, predicted speedup and steps by strategy."""
        planned = self.total(m, "planned_passes", cat)
        out = {
            "expected_tokens_per_pass": self.total(m, "expected_tokens", cat) / planned if planned else None,
            "predicted_speedup": self.predicted(m, cat),
            "strategies": {},
        }
        for r in self.picked(m, cat):
            for k, v in (r.get("strategies") or {}).items():
                out["strategies"][k] = out["strategies"].get(k, 0) + v
        return out


def _ratio(a, b):
    return a / b if a and b else None


def summarize(rows: list[dict], methods: list[str], *, gamma: int, greedy: bool, config: dict) -> dict:
    """Per-method totals, speedups against autoregressive from the same run, the analytic bound."""
    rs = _Rows(rows, methods, config)
    return {"config": config, "methods": {m: _summarize_method(rs, m, greedy) for m in methods}, "prompts": rows}


def _summarize_method(rs: _Rows, m: str, greedy: bool) -> dict:
    total, ar_step = rs.total, rs.ar_step
    mine = rs.picked(m)
    res = {
        **rs.speeds(m),
        "new_tokens": total(m, "new_tokens"),
        "wall_s": total(m, "wall_s"),
        "mean_accepted_tokens": None,
        "acceptance_rate": None,
        "alpha": None,
        "draft_cost_ratio": None,
        "verify_cost_ratio": None,
        "analytic_bound": None,
        "efficiency": None,
        "cost_model_bound": None,
        "acceptance_by_position": None,
        "greedy_agreement": None,
    }
    fwd = total(m, "target_forwards")
    if m not in PEERS and fwd:
        res["mean_accepted_tokens"] = total(m, "new_tokens") / fwd
        res["verify_cost_ratio"] = total(m, "verify_s") / fwd / ar_step if ar_step else None
    if has_flag(m, "planned") and fwd:
        res["nodes_per_pass"] = total(m, "drafted") / fwd
        res["depth_per_pass"] = total(m, "tree_depth") / fwd
        res.update(rs.planned(m))
    if has_flag(m, "drafts") and fwd and ar_step:
        # what the drafter costs per target pass, in plain steps (c of a step, whatever it drafted)
        res["draft_cost_per_pass"] = total(m, "draft_s") / fwd / ar_step
    if any(r.get("sources") for r in mine):
        res["sources"] = _by_source(mine)
    if any(r.get("engine") for r in mine):  # --route: which engine served how many prompts
        res["engines"] = {
            e: sum(r.get("engine") == e for r in mine) for e in sorted({r["engine"] for r in mine if r.get("engine")})
        }
    turns = sorted({r.get("turn", 1) for r in mine})
    if len(turns) > 1:
        res["by_turn"] = _by_turn(mine, turns)
    if has_flag(m, "drafts") and total(m, "drafted"):
        _acceptance(rs, m, mine, res)
    if greedy and m != BASELINE:
        res["greedy_agreement"] = sum(r["token_ids"] == rs.ar_ids.get(r["prompt_id"]) for r in mine) / len(mine)
    cats = sorted({r["category"] for r in mine if r["category"]})
    if cats:
        res["by_category"] = {cat: _category(rs, m, cat) for cat in cats}
    return res


def _by_source(mine: list[dict]) -> dict:
    by: dict = {}
    for r in mine:
        for src, v in (r.get("sources") or {}).items():
            d = by.setdefault(src, {"drafted": 0, "accepted": 0})
            d["drafted"] += v["drafted"]
            d["accepted"] += v["accepted"]
    for d in by.values():
        d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else None
    return by


def _by_turn(mine: list[dict], turns: list[int]) -> dict:
    out = {}
    for t in turns:
        rt = [r for r in mine if r.get("turn", 1) == t]
        fwd = sum(r["target_forwards"] or 0 for r in rt)
        wall = sum(r["wall_s"] for r in rt)
        out[t] = {
            "tokens_per_second": sum(r["new_tokens"] for r in rt) / wall if wall else None,
            "mean_accepted_tokens": sum(r["new_tokens"] for r in rt) / fwd if fwd else None,
        }
    return out


def _acceptance(rs: _Rows, m: str, mine: list[dict], res: dict) -> None:
    """A drafting method's acceptance, by position too; for a chain also alpha, c and the bounds (into res)."""
    total, ar_step = rs.total, rs.ar_step
    acc, drafted = total(m, "accepted"), total(m, "drafted")
    res["acceptance_rate"] = acc / drafted
    # a tree's α and bound would need its branching: the chain formulas apply to chains only
    chain = has_flag(m, "chain")
    res["alpha"] = alpha = alpha_from_counts(acc, total(m, "rejections")) if chain else None
    res["draft_cost_ratio"] = c = (total(m, "draft_s") / drafted / ar_step) if ar_step and chain else None
    # the tokens actually drafted per pass: prompt lookup often finds fewer than gamma, or none
    g = drafted / total(m, "target_forwards")
    if alpha is not None and c is not None:
        res["analytic_bound"] = analytic_bound(alpha, g, c)
        res["efficiency"] = res["speedup"] / res["analytic_bound"] if res["speedup"] else None
        if res["verify_cost_ratio"]:
            res["cost_model_bound"] = cost_model_bound(alpha, g, c, res["verify_cost_ratio"])
    width = max(len(r["drafted_per_position"] or []) for r in mine)
    res["acceptance_by_position"] = [
        sum((r["accepted_per_position"] or [0] * width)[i] for r in mine if len(r["drafted_per_position"] or []) > i)
        / max(1, sum(r["drafted_per_position"][i] for r in mine if len(r["drafted_per_position"] or []) > i))
        for i in range(width)
    ]


def _category(rs: _Rows, m: str, cat: str) -> dict:
    bc = rs.speeds(m, cat)
    if m not in PEERS:
        fwd = rs.total(m, "target_forwards", cat)
        bc["mean_accepted_tokens"] = rs.total(m, "new_tokens", cat) / fwd if fwd else None
    if has_flag(m, "planned") and rs.total(m, "target_forwards", cat):
        bc.update(rs.planned(m, cat))
    return bc
