"""`specdecode bench`: every method against plain decoding (and Hugging Face assisted generation)
on a prompt file, in one run, interleaved prompt by prompt so that machine drift hits all alike.

Writes results.json, report.md, speedup.png and acceptance.png to --out.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .engine import METHODS, Engine
from .lookup import History
from .errors import SpecDecodeError
from .methods import BASELINE, METHOD_TABLE, REQUIRED, in_default_run, wants_draft_model

PEERS = ("hf-assisted", "llama.cpp", "llama.cpp-pld")  # other tools' decoders, measured in the same run
DRAFT_PEERS = ("hf-assisted",)  # the peers that run our draft model
BENCH_METHODS = (*METHODS, *PEERS)


def _is(m: str, need: str) -> bool:
    """Whether method m (a name in the method table; a peer never) has the table's flag `need`."""
    return m in METHOD_TABLE and bool(getattr(METHOD_TABLE[m], need))


def load_prompts(path: str | Path, limit: int | None = None, all_turns: bool = False) -> list[dict]:
    """JSONL rows with `prompt` (raw completion) or `turns` (chat: the first turn, or with all_turns
    every turn, as one conversation), optional `category`."""
    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"prompt file not found: {path}")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecDecodeError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SpecDecodeError(f"{path}:{lineno}: expected a JSON object")
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            row = {"prompt": obj["prompt"], "chat": False}
        elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
            row = {"prompt": obj["turns"][0], "chat": True}
            if all_turns:
                if not all(isinstance(t, str) and t for t in obj["turns"]):
                    raise SpecDecodeError(f"{path}:{lineno}: every turn must be a non-empty string")
                row["turns"] = list(obj["turns"])
        else:
            raise SpecDecodeError(f"{path}:{lineno}: needs a non-empty 'prompt' string or a 'turns' list of strings")
        row["id"] = str(obj.get("task_id", obj.get("question_id", lineno)))
        row["category"] = obj.get("category") if isinstance(obj.get("category"), str) else None
        rows.append(row)
        if limit and len(rows) >= limit:
            break
    if not rows:
        raise SpecDecodeError(f"{path}: no prompts")
    return rows


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in BENCH_METHODS]
    if bad or not methods:
        raise SpecDecodeError(f"unknown method(s) {', '.join(bad) or '(none)'}; choose from {', '.join(BENCH_METHODS)}")
    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # the baseline every speedup is measured against
    return methods


def default_methods(engine: Engine) -> list[str]:
    methods = [m for m in in_default_run("bench_default")  # the method table's default run
               if engine.draft_model is not None or METHOD_TABLE[m].needs_draft_model != REQUIRED]
    if engine.backend == "llama.cpp":
        return methods + ["llama.cpp", "llama.cpp-pld"]
    return methods + (["hf-assisted"] if engine.draft_model is not None else [])


def needs_draft_model(methods: list[str]) -> bool:
    """Whether a bench of these methods loads the draft model (some method or peer uses one)."""
    return wants_draft_model(methods) or bool(set(DRAFT_PEERS) & set(methods))


def check_methods(engine: Engine, methods: list[str]) -> None:
    required = [m for m in METHODS if METHOD_TABLE[m].needs_draft_model == REQUIRED] + list(DRAFT_PEERS)
    if engine.draft_model is None and set(required) & set(methods):
        raise SpecDecodeError(f"methods {' and '.join(required)} need a draft model (--draft)")
    if "hf-assisted" in methods and engine.backend != "torch":
        raise SpecDecodeError("the hf-assisted peer runs on the torch backend (--backend torch)")
    if {"llama.cpp", "llama.cpp-pld"} & set(methods) and engine.backend != "llama.cpp":
        raise SpecDecodeError("the llama.cpp peers need the target on the llama.cpp backend (a GGUF model, "
                              "--backend llama.cpp or auto)")


class LlamaPeer:
    """llama-cpp-python's own high-level greedy generation on the same GGUF file and thread count
    (with its LlamaPromptLookupDecoding for llama.cpp-pld): what a user would run instead of us."""

    def __init__(self, engine: Engine, pld: bool):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        lm = engine.target
        self.eos = engine.eos_ids
        self.llm = Llama(model_path=str(lm.path), n_ctx=min(lm.max_length, 4096), n_threads=lm.threads,
                         n_threads_batch=lm.threads, n_gpu_layers=0, verbose=False,
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if pld else None)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed) -> dict:
        if temperature != 0:
            raise SpecDecodeError("the llama.cpp peers are benchmarked greedy only (--temperature 0)")
        self.llm.reset()  # no prefix reuse from the previous prompt: each run prefills, as ours do
        ids = []
        ttft = None
        t = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                     reset=True):
            if ttft is None:  # the first token out: the prefill and one sampling step
                ttft = time.perf_counter() - t
            ids.append(int(tok))
            if tok in self.eos or len(ids) >= max_new_tokens:
                break
        wall = time.perf_counter() - t
        return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": ttft}


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


def hf_assisted(engine: Engine, prompt_ids: list[int], gamma: int, max_new_tokens: int,
                temperature: float, seed: int | None) -> dict:
    """The peer: transformers' assisted generation with the same models (its default schedule)."""
    target, draft = engine.target.model, engine.draft_model.lm.model
    x = torch.tensor([prompt_ids], device=engine.target.device)
    # neutral settings, so that a checkpoint's own generation config (repetition penalty, top-p...) does
    # not make the peer decode a different distribution; its assistant schedule stays HF's default
    kwargs = dict(top_k=None, top_p=None, repetition_penalty=None)
    kwargs.update(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature))
    if seed is not None:
        torch.manual_seed(seed)
    draft.generation_config.num_assistant_tokens = gamma
    t = time.perf_counter()
    out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(engine.eos_ids) or None,
                          pad_token_id=min(engine.eos_ids, default=None), **kwargs)
    wall = time.perf_counter() - t
    ids = out[0, len(prompt_ids):].tolist()
    # generate() returns everything at once: no time to first token (so no decode speed either)
    return {"token_ids": ids, "new_tokens": len(ids), "wall_s": wall, "ttft_s": None}


def run_bench(engine: Engine, prompts: list[dict], methods: list[str], *, gamma: int = 4, max_new_tokens: int = 128,
              temperature: float = 0.0, seed: int | None = 0, progress: bool = True, tree: dict | None = None) -> dict:
    """tree: tree_width/tree_depth/tree_nodes for method tree (unset: chosen by its cost model)."""
    greedy = temperature == 0
    tree = tree or {}
    costs = engine.tree_costs()  # the measured T(k)/T(1) curve and draft cost, shown next to the speed table
    peers = {m: LlamaPeer(engine, pld=m == "llama.cpp-pld") for m in methods if m in ("llama.cpp", "llama.cpp-pld")}
    # with an engine history, every method remembers only its own earlier outputs (never the text another
    # method wrote for the same prompt), and the warm-up leaves none
    history = engine.history
    histories = {m: History(history.max_tokens) if history is not None else None for m in methods}
    engine.history = None
    # warm-up (excluded): first calls pay for allocations and kernel selection
    for m in methods:
        _run_one(engine, {**prompts[0], "turns": None}, m, gamma, 8, temperature, seed, tree, peers)
    rows = []
    runs = sum(len(p.get("turns") or [0]) for p in prompts) * len(methods)
    bar = tqdm(total=runs, desc="bench", unit="run", disable=not progress)
    try:
        for p in prompts:
            for m in methods:  # interleaved, prompt by prompt
                engine.history = histories[m]
                messages: list[dict] = []
                for turn, text in enumerate(p.get("turns") or [p["prompt"]], 1):
                    bar.set_postfix_str(f"{p['id']} {m}" + (f" turn {turn}" if p.get("turns") else ""))
                    if p.get("turns"):  # a conversation: each turn after this method's own earlier answers
                        messages = messages + [{"role": "user", "content": text}]
                        run = {**p, "prompt": messages, "chat": True}
                    else:
                        run = p
                    r = _run_one(engine, run, m, gamma, max_new_tokens, temperature, seed, tree, peers)
                    rows.append({"prompt_id": p["id"] + (f"#{turn}" if p.get("turns") else ""), "turn": turn,
                                 "category": p["category"], "method": m, **r})
                    if p.get("turns"):
                        messages = messages + [{"role": "assistant", "content": r["text"]}]
                    bar.update(1)
    finally:
        engine.history = history
    bar.close()
    return summarize(rows, methods, gamma=gamma, greedy=greedy,
                     config=dict(gamma=gamma, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                 prompts=len(prompts), methods=methods, device=str(engine.target.device),
                                 backend=engine.backend, target=engine.target.name,
                                 draft=engine.draft_model.lm.name if engine.draft_model else None,
                                 dtype=str(engine.target.dtype).replace("torch.", ""),
                                 draft_dtype=str(engine.draft_model.lm.dtype).replace("torch.", "")
                                 if engine.draft_model else None,
                                 threads=getattr(engine.target, "threads", torch.get_num_threads()),
                                 torch_threads=torch.get_num_threads(), tree=tree, cpu=cpu_description(),
                                 draft_quant=getattr(engine.draft_model.lm, "quant_info", None)
                                 if engine.draft_model else None,
                                 pass_costs=costs.as_dict(),
                                 datastore=str(engine.datastore.path) if engine.datastore else None,
                                 datastore_tokens=len(engine.datastore) if engine.datastore else None,
                                 history_tokens=history.max_tokens if history is not None else 0,
                                 draft_vocab=len(engine.draft_model.keep)
                                 if engine.draft_model is not None and engine.draft_model.keep is not None else None))


def cpu_description() -> str:
    """CPU model and the vector/matrix flags that decide which kernels run."""
    from .machine import cpu_name
    flags = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    import os
    return f"{cpu_name() or 'unknown CPU'}, {os.cpu_count()} logical CPUs, flags: {' '.join(flags) or 'n/a'}"


def decode_rate(new_tokens: int, wall_s: float, ttft_s: float | None, first_tokens: int = 1) -> float | None:
    """Tokens after the first step's, per second after it (Stats.decode_tokens_per_second's rule)."""
    if ttft_s is None or new_tokens <= first_tokens or wall_s <= ttft_s:
        return None
    return (new_tokens - first_tokens) / (wall_s - ttft_s)


def _run_one(engine, p, method, gamma, max_new_tokens, temperature, seed, tree=None, peers=None) -> dict:
    if method in PEERS:
        ids = engine.encode(p["prompt"], p["chat"])
        if method == "hf-assisted":
            r = hf_assisted(engine, ids, gamma, max_new_tokens, temperature, seed)
        else:
            r = peers[method].generate(ids, max_new_tokens, temperature, seed)
        text = engine.decode(r["token_ids"]) if "token_ids" in r else ""
        r.setdefault("ttft_s", None)
        return {**r, "text": text, "tokens_per_second": r["new_tokens"] / r["wall_s"],
                "decode_tokens_per_second": decode_rate(r["new_tokens"], r["wall_s"], r["ttft_s"]),
                "plain_step_s": None, "target_forwards": None, "drafted": None,
                "accepted": None, "rejections": None, "mean_accepted_tokens": None, "acceptance_rate": None,
                "accepted_per_position": None, "drafted_per_position": None, "draft_s": None, "verify_s": None,
                "tree_depth": None, "expected_tokens": None, "planned_passes": None, "modelled_s": None,
                "strategies": None, "sources": None}
    g = engine.generate(p["prompt"], chat=p["chat"], method=method, gamma=gamma, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=seed, **(tree or {} if _is(method, "tree_options") else {}))
    s = g.stats
    return {"token_ids": g.token_ids, "text": g.text, "new_tokens": s.new_tokens, "wall_s": s.wall_s, "sources": s.sources,
            "tokens_per_second": s.tokens_per_second, "target_forwards": s.target_forwards, "drafted": s.drafted,
            "accepted": s.accepted, "rejections": s.rejections, "mean_accepted_tokens": s.mean_accepted_tokens,
            "acceptance_rate": s.acceptance_rate, "accepted_per_position": s.accepted_per_position,
            "drafted_per_position": s.drafted_per_position, "draft_s": s.draft_s, "verify_s": s.verify_s,
            "prefill_s": s.prefill_s, "ttft_s": s.ttft_s, "first_tokens": s.first_tokens,
            "decode_tokens_per_second": s.decode_tokens_per_second, "catchup_s": s.catchup_s,
            "tree_depth": s.tree_depth, "expected_tokens": s.expected_tokens, "planned_passes": s.planned_passes,
            "modelled_s": s.modelled_s, "plain_step_s": s.plain_step_s, "strategies": s.strategies}


def summarize(rows: list[dict], methods: list[str], *, gamma: int, greedy: bool, config: dict) -> dict:
    """Per-method totals, speedups against autoregressive from the same run, the analytic bound."""
    def total(m, key, cat=None):
        return sum(r[key] for r in rows
                   if r["method"] == m and r[key] is not None and (cat is None or r["category"] == cat))

    def tps(m, cat=None):
        wall = total(m, "wall_s", cat)
        return total(m, "new_tokens", cat) / wall if wall else None

    def picked(m, cat=None):
        return [r for r in rows if r["method"] == m and (cat is None or r["category"] == cat)]

    def dtps(m, cat=None):
        """Decode tok/s: tokens after each run's first / seconds after its first (runs with a TTFT)."""
        timed = [r for r in picked(m, cat) if r.get("ttft_s") is not None and r["new_tokens"] >= 1]
        seconds = sum(r["wall_s"] - r["ttft_s"] for r in timed)
        return sum(r["new_tokens"] - (r.get("first_tokens") or 1) for r in timed) / seconds if seconds > 0 else None

    def mean_ttft(m, cat=None):
        ttfts = [r["ttft_s"] for r in picked(m, cat) if r.get("ttft_s") is not None]
        return sum(ttfts) / len(ttfts) if ttfts else None

    def ratio(a, b):
        return a / b if a and b else None

    peer = "llama.cpp" if "llama.cpp" in methods and picked("llama.cpp") else None  # issue 16's yardstick

    def speeds(m, cat=None) -> dict:
        """Overall and decode speed, TTFT and the ratios against autoregressive and the llama.cpp peer."""
        t, d = tps(m, cat), dtps(m, cat)
        return {"tokens_per_second": t, "speedup": ratio(t, tps(BASELINE, cat)),
                "decode_tokens_per_second": d, "decode_speedup": ratio(d, dtps(BASELINE, cat)),
                "ttft_s": mean_ttft(m, cat),
                "vs_llama_cpp": {"overall": ratio(t, tps(peer, cat)), "decode": ratio(d, dtps(peer, cat))}
                if peer else None}

    def predicted(m, cat=None):
        """The cost model's speedup over the planned passes: expected tokens / modelled seconds counted in
        plain steps (each run's own plain step where it has one, else the measured 1-token pass)."""
        fallback = (config.get("pass_costs") or {}).get("target_s_1")
        expected = steps = 0.0
        for r in picked(m, cat):
            plain = r.get("plain_step_s") or fallback
            if r.get("modelled_s") and plain:
                expected += r.get("expected_tokens") or 0.0
                steps += r["modelled_s"] / plain
        return expected / steps if steps else None

    ar_step = (total(BASELINE, "verify_s") / total(BASELINE, "target_forwards")
               if total(BASELINE, "target_forwards") else None)
    ar_ids = {r["prompt_id"]: r["token_ids"] for r in rows if r["method"] == BASELINE}
    out = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        res = {**speeds(m), "new_tokens": total(m, "new_tokens"), "wall_s": total(m, "wall_s"),
               "mean_accepted_tokens": None, "acceptance_rate": None, "alpha": None, "draft_cost_ratio": None,
               "verify_cost_ratio": None, "analytic_bound": None, "efficiency": None, "cost_model_bound": None,
               "acceptance_by_position": None, "greedy_agreement": None}
        if m not in PEERS and total(m, "target_forwards"):
            fwd = total(m, "target_forwards")
            res["mean_accepted_tokens"] = total(m, "new_tokens") / fwd
            res["verify_cost_ratio"] = total(m, "verify_s") / fwd / ar_step if ar_step else None
        if _is(m, "planned") and total(m, "target_forwards"):
            fwd = total(m, "target_forwards")
            res["nodes_per_pass"] = total(m, "drafted") / fwd
            res["depth_per_pass"] = total(m, "tree_depth") / fwd
            planned = total(m, "planned_passes")
            res["expected_tokens_per_pass"] = total(m, "expected_tokens") / planned if planned else None
            res["predicted_speedup"] = predicted(m)
            res["strategies"] = {}
            for r in mine:
                for k, v in (r["strategies"] or {}).items():
                    res["strategies"][k] = res["strategies"].get(k, 0) + v
        if _is(m, "drafts") and total(m, "target_forwards") and ar_step:
            # what the drafter costs per target pass, in plain steps (c of a step, whatever it drafted)
            res["draft_cost_per_pass"] = total(m, "draft_s") / total(m, "target_forwards") / ar_step
        if any(r.get("sources") for r in mine):
            by: dict = {}
            for r in mine:
                for src, v in (r.get("sources") or {}).items():
                    d = by.setdefault(src, {"drafted": 0, "accepted": 0})
                    d["drafted"] += v["drafted"]
                    d["accepted"] += v["accepted"]
            for d in by.values():
                d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else None
            res["sources"] = by
        turns = sorted({r.get("turn", 1) for r in mine})
        if len(turns) > 1:
            res["by_turn"] = {}
            for t in turns:
                rt = [r for r in mine if r.get("turn", 1) == t]
                fwd = sum(r["target_forwards"] or 0 for r in rt)
                wall = sum(r["wall_s"] for r in rt)
                res["by_turn"][t] = {"tokens_per_second": sum(r["new_tokens"] for r in rt) / wall if wall else None,
                                     "mean_accepted_tokens": sum(r["new_tokens"] for r in rt) / fwd if fwd else None}
        if _is(m, "drafts") and total(m, "drafted"):
            acc, drafted = total(m, "accepted"), total(m, "drafted")
            res["acceptance_rate"] = acc / drafted
            # a tree's α and bound would need its branching: the chain formulas apply to chains only
            chain = _is(m, "chain")
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
                for i in range(width)]
        if greedy and m != BASELINE:
            res["greedy_agreement"] = sum(r["token_ids"] == ar_ids.get(r["prompt_id"]) for r in mine) / len(mine)
        cats = sorted({r["category"] for r in mine if r["category"]})
        if cats:
            res["by_category"] = {}
            for cat in cats:
                bc = res["by_category"][cat] = speeds(m, cat)
                if m not in PEERS:
                    fwd = total(m, "target_forwards", cat)
                    bc["mean_accepted_tokens"] = total(m, "new_tokens", cat) / fwd if fwd else None
                if _is(m, "planned") and total(m, "target_forwards", cat):
                    planned = total(m, "planned_passes", cat)
                    bc["expected_tokens_per_pass"] = total(m, "expected_tokens", cat) / planned if planned else None
                    bc["predicted_speedup"] = predicted(m, cat)
                    bc["strategies"] = {}
                    for r in picked(m, cat):
                        for k, v in (r.get("strategies") or {}).items():
                            bc["strategies"][k] = bc["strategies"].get(k, 0) + v
        out[m] = res
    return {"config": config, "methods": out, "prompts": rows}


def write_outputs(results: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results))
    plot_speedup(results, out / "speedup.png")
    plot_acceptance(results, out / "acceptance.png")
    return out


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


_SPEED_HEAD = ("TTFT s | decode tok/s | overall tok/s | decode speedup | overall speedup | vs llama.cpp overall | "
               "vs llama.cpp decode")


def _speed_cells(r: dict) -> str:
    """The cells of _SPEED_HEAD for a method's (or a category's) speeds."""
    vs = r.get("vs_llama_cpp") or {}
    return (f"{_f(r.get('ttft_s'), '{:.3f}')} | {_f(r.get('decode_tokens_per_second'))} | "
            f"{_f(r.get('tokens_per_second'))} | {_f(r.get('decode_speedup'), '{:.2f}x')} | "
            f"{_f(r.get('speedup'), '{:.2f}x')} | {_f(vs.get('overall'), '{:.2f}x')} | {_f(vs.get('decode'), '{:.2f}x')}")


def report(results: dict) -> str:
    cfg = results["config"]
    lines = ["# specdecode bench\n",
             f"{cfg['prompts']} prompts, max_new_tokens={cfg['max_new_tokens']}, gamma={cfg['gamma']}, "
             f"temperature={cfg['temperature']}, {cfg.get('backend', 'torch')} backend on {cfg['device']}: target "
             f"{cfg.get('target', '?')} ({cfg['dtype']}), draft {cfg.get('draft') or '–'} ({cfg.get('draft_dtype') or '–'}), "
             f"{cfg.get('threads', cfg['torch_threads'])} threads\n",
             f"CPU: {cfg.get('cpu', 'n/a')}\n",
             *([f"Lookup sources: datastore {cfg['datastore']} ({cfg['datastore_tokens']:,} tokens)"
                + (f"; history {cfg['history_tokens']:,} tokens per method" if cfg.get("history_tokens") else "") + "\n"]
               if cfg.get("datastore") else [f"Lookup sources: history {cfg['history_tokens']:,} tokens per method\n"]
               if cfg.get("history_tokens") else []),
             *([f"Draft output layer: {cfg['draft_vocab']:,} rows (FR-Spec)\n"] if cfg.get("draft_vocab") else []),
             "| method | tok/s | speedup vs autoregressive | tokens per target pass (τ) | acceptance rate | α | "
             "draft cost c | verify cost v | Leviathan bound | efficiency | bound with measured v | greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, r in results["methods"].items():
        lines.append(f"| {m} | {_f(r['tokens_per_second'])} | {_f(r['speedup'], '{:.2f}x')} | "
                     f"{_f(r['mean_accepted_tokens'])} | {_f(r['acceptance_rate'], '{:.1%}')} | {_f(r['alpha'])} | "
                     f"{_f(r['draft_cost_ratio'], '{:.3f}')} | {_f(r['verify_cost_ratio'])} | "
                     f"{_f(r['analytic_bound'], '{:.2f}x')} | {_f(r['efficiency'], '{:.0%}')} | "
                     f"{_f(r.get('cost_model_bound'), '{:.2f}x')} | {_f(r['greedy_agreement'], '{:.0%}')} |")
    cats = sorted({c for r in results["methods"].values() for c in r.get("by_category", {})})
    lines += ["\n## Prefill and decoding\n",
              "TTFT: mean seconds to the first token (the prefill included). Decode tok/s: tokens after each run's "
              "first / seconds after it. Overall tok/s: all tokens / all seconds. vs llama.cpp: against "
              "llama-cpp-python's own plain generation in the same run.\n",
              "| method | " + _SPEED_HEAD + " |", "|---" * 8 + "|"]
    for m, r in results["methods"].items():
        lines.append(f"| {m} | {_speed_cells(r)} |")
    if cats:
        lines += ["\n### Prefill and decoding by category\n", "| category | method | " + _SPEED_HEAD + " |",
                  "|---" * 9 + "|"]
        for c in cats:
            for m, r in results["methods"].items():
                if c in r.get("by_category", {}):
                    lines.append(f"| {c} | {m} | {_speed_cells(r['by_category'][c])} |")
    if cats:
        lines += ["\n## Speedup by category\n", "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for m, r in results["methods"].items():
            bc = r.get("by_category", {})
            lines.append(f"| {m} | " + " | ".join(_f(bc.get(c, {}).get("speedup"), "{:.2f}x") for c in cats) + " |")
    srcs = [m for m, r in results["methods"].items() if r.get("sources") or r.get("draft_cost_per_pass") is not None]
    if srcs:
        lines += ["\n## Drafters: cost and where accepted tokens came from\n",
                  "Draft cost per pass: the drafter's time per target pass, in plain decoding steps. Per source: "
                  "tokens drafted, accepted, and the acceptance rate.\n",
                  "| method | draft cost per pass | " + " | ".join(("draft model", "context", "history", "datastore")) + " |",
                  "|---" * 6 + "|"]
        for m in srcs:
            r = results["methods"][m]
            cells = []
            for src in ("draft", "context", "history", "datastore"):
                d = (r.get("sources") or {}).get(src)
                cells.append("–" if not d else f"{d['accepted']}/{d['drafted']} ({_f(d['acceptance_rate'], '{:.0%}')})")
            lines.append(f"| {m} | {_f(r.get('draft_cost_per_pass'), '{:.3f}')} | " + " | ".join(cells) + " |")
    turns = sorted({t for r in results["methods"].values() for t in r.get("by_turn", {})})
    if turns:
        lines += ["\n## By turn (each conversation goes on after the method's own earlier answers)\n",
                  "| method | " + " | ".join(f"turn {t}: tok/s | turn {t}: tokens per pass" for t in turns) + " |",
                  "|---" * (2 * len(turns) + 1) + "|"]
        for m, r in results["methods"].items():
            bt = r.get("by_turn", {})
            lines.append(f"| {m} | " + " | ".join(f"{_f(bt.get(t, {}).get('tokens_per_second'))} | "
                                                  f"{_f(bt.get(t, {}).get('mean_accepted_tokens'))}" for t in turns) + " |")
    costs = cfg.get("pass_costs") or {}
    if costs.get("target"):
        ks = list(costs["target"])
        lines += ["\n## Pass costs on this machine (the cost model)\n",
                  f"One target pass over k new tokens after 128 cached, relative to a 1-token pass of "
                  f"{costs['target_s_1'] * 1000:.1f} ms; one draft pass over k tokens in the same unit.\n",
                  "| k | " + " | ".join(str(k) for k in ks) + " |", "|---" * (len(ks) + 1) + "|",
                  "| target T(k)/T(1) | " + " | ".join(f"{costs['target'][k]:.2f}" for k in ks) + " |"]
        if costs.get("draft"):
            lines.append("| draft d(k)/T(1) | " + " | ".join(_f(costs["draft"].get(k)) for k in ks) + " |")
        dq = cfg.get("draft_quant") or {}
        if dq.get("one_token_s"):
            lines.append("\nDraft requantized for speed (the draft never changes the output): one-token draft pass, "
                         "as a share of a target pass (c): " + ", ".join(
                             f"{n} ({dq['file_type'].get(n, n)}) {s / costs['target_s_1']:.2f}" + (" ← chosen" if n == dq["chosen"] else "")
                             for n, s in dq["one_token_s"].items()))
    auto = results["methods"].get("auto")
    if auto and auto.get("strategies"):
        lines += ["\n## auto\n", "| steps by strategy | expected tokens per pass | realised (τ) | "
                  "predicted speedup (cost model) | realised speedup | realised / predicted |", "|---|---|---|---|---|---|",
                  f"| {', '.join(f'{k} {v}' for k, v in auto['strategies'].items())} | "
                  f"{_f(auto.get('expected_tokens_per_pass'))} | {_f(auto['mean_accepted_tokens'])} | "
                  f"{_f(auto.get('predicted_speedup'), '{:.2f}x')} | {_f(auto['speedup'], '{:.2f}x')} | "
                  f"{_f(auto['speedup'] / auto['predicted_speedup'] if auto['speedup'] and auto.get('predicted_speedup') else None, '{:.0%}')} |"]
        bc = {c: v for c, v in auto.get("by_category", {}).items() if "predicted_speedup" in v}
        if bc:
            lines += ["\n### auto by category: predicted against realised\n",
                      "Predicted: the cost model's expected tokens per modelled second of the passes it planned, "
                      "in plain steps (decoding only: no prefill). Realised: against our autoregressive in the "
                      "same run, in decode tok/s (after the first token) and overall.\n",
                      "| category | steps by strategy | expected tokens per pass | realised (τ) | predicted speedup | "
                      "realised decode speedup | realised overall speedup | realised decode / predicted |",
                      "|---" * 8 + "|"]
            for c, v in bc.items():
                pred, dec = v.get("predicted_speedup"), v.get("decode_speedup")
                lines.append(f"| {c} | {', '.join(f'{k} {n}' for k, n in (v.get('strategies') or {}).items()) or '–'} | "
                             f"{_f(v.get('expected_tokens_per_pass'))} | {_f(v.get('mean_accepted_tokens'))} | "
                             f"{_f(pred, '{:.2f}x')} | {_f(dec, '{:.2f}x')} | {_f(v.get('speedup'), '{:.2f}x')} | "
                             f"{_f(dec / pred if dec and pred else None, '{:.0%}')} |")
    tree = results["methods"].get("tree")
    if tree and tree.get("nodes_per_pass") is not None:
        costs = cfg.get("pass_costs") or {}
        lines += ["\n## Token tree\n", f"shape fixed by hand: {cfg.get('tree') or 'none (cost model)'}\n",
                  "| nodes per pass | depth per pass | expected tokens per pass | realised (τ) | "
                  "draft time per pass / plain step | verify cost v |", "|---|---|---|---|---|---|",
                  f"| {_f(tree['nodes_per_pass'])} | {_f(tree['depth_per_pass'])} | "
                  f"{_f(tree['expected_tokens_per_pass'])} | {_f(tree['mean_accepted_tokens'])} | "
                  f"{_f(tree.get('draft_cost_per_pass'))} | {_f(tree['verify_cost_ratio'])} |"]
        if costs.get("target"):
            lines.append("\nMeasured pass costs (cost model, relative to a 1-token target pass of "
                         f"{costs['target_s_1'] * 1000:.0f} ms): target " +
                         ", ".join(f"{n} tok {r:.2f}" for n, r in costs["target"].items()) + "; draft " +
                         ", ".join(f"{n} tok {r:.2f}" for n, r in costs["draft"].items()))
    lines += ["\n## Per prompt\n", "| prompt | method | tok/s | TTFT s | decode tok/s | new tokens | τ | acceptance |",
              "|---" * 8 + "|"]
    for r in results["prompts"]:
        lines.append(f"| {r['prompt_id']} | {r['method']} | {_f(r['tokens_per_second'])} | "
                     f"{_f(r.get('ttft_s'), '{:.3f}')} | {_f(r.get('decode_tokens_per_second'))} | {r['new_tokens']} | "
                     f"{_f(r['mean_accepted_tokens'])} | {_f(r['acceptance_rate'], '{:.1%}')} |")
    lines.append("\nα: per-token acceptance, accepted / (accepted + rejections). c: mean time of one draft "
                 "forward / one plain target forward. Bound: Leviathan et al. 2023, Thm 3.8, "
                 "(1 − α^(γ+1)) / ((1 − α)(γc + 1)), which assumes a (γ+1)-token target pass costs what a "
                 "1-token pass does. v: mean verify pass time / one plain target forward; 'bound with measured v' "
                 "is the same expectation divided by (γc + v) instead of (γc + 1).")
    return "\n".join(lines) + "\n"


def plot_speedup(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = list(results["methods"])
    cats = sorted({c for r in results["methods"].values() for c in r.get("by_category", {})})
    groups = ["all prompts"] + cats
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups) * len(methods) / 2), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        r = results["methods"][m]
        vals = [r["speedup"] or 0] + [(r.get("by_category", {}).get(c, {}).get("speedup") or 0) for c in cats]
        bars = ax.bar([g + i * width for g in range(len(groups))], vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(groups))], groups, rotation=20 if cats else 0)
    ax.set_ylabel("speedup vs autoregressive (×, tokens/s ratio)")
    cfg = results["config"]
    ax.set_title(f"Speedup, {cfg['prompts']} prompts, {cfg['max_new_tokens']} new tokens, γ={cfg['gamma']}, T={cfg['temperature']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, r in results["methods"].items():
        acc = r.get("acceptance_by_position")
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=m)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position (1 = first drafted token)")
    ax.set_ylabel("share of drafted tokens accepted")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
