"""`specdecode bench`: every method against plain decoding (and other tools' decoders, peers.py) on a
prompt file, in one run, interleaved prompt by prompt so that machine drift hits all alike."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..drafters import History
from ..engine import METHODS, Engine
from ..errors import SpecDecodeError
from ..host import cpu_description
from ..launch.describe import hugepages_status
from ..methods import BASELINE, DEFAULT_GAMMA, METHOD_TABLE, REQUIRED, in_default_run, wants_draft_model
from ..request import Request
from .bound import COPIED, copy_bound, oracle_bound, timed_copy_bound
from .peers import BENCH_METHODS, DRAFT_PEERS, PEERS, LlamaPeer, has_flag, hf_assisted
from .server_peer import SERVER_PEERS, close_peers, make_server_peers
from .summary import decode_rate, summarize


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in BENCH_METHODS]
    if bad or not methods:
        raise SpecDecodeError(f"unknown method(s) {', '.join(bad) or '(none)'}; choose from {', '.join(BENCH_METHODS)}")
    if BASELINE not in methods:
        methods.insert(0, BASELINE)  # the baseline every speedup is measured against
    return methods


def default_methods(engine: Engine) -> list[str]:
    methods = [
        m
        for m in in_default_run("bench_default")  # the method table's default run
        if engine.draft_model is not None or METHOD_TABLE[m].needs_draft_model != REQUIRED
    ]
    if engine.target.gguf_path is not None:  # a GGUF file that llama-cpp-python's own generation can run
        return methods + ["llama.cpp", "llama.cpp-pld"]
    return methods + (["hf-assisted"] if engine.draft_model is not None else [])


def needs_draft_model(methods: list[str]) -> bool:
    """Whether a bench of these methods loads the draft model (some method or peer uses one)."""
    return wants_draft_model(methods) or bool(set(DRAFT_PEERS) & set(methods))


def check_methods(engine: Engine, methods: list[str]) -> None:
    required = [m for m in METHODS if METHOD_TABLE[m].needs_draft_model == REQUIRED] + list(DRAFT_PEERS)
    asked = [m for m in required if m in methods]
    if engine.draft_model is None and asked:
        raise SpecDecodeError(
            f"{'methods' if len(asked) > 1 else 'method'} {' and '.join(asked)} "
            f"need{'' if len(asked) > 1 else 's'} a draft model (--draft)"
        )
    if "hf-assisted" in methods and engine.target.hf_model is None:
        raise SpecDecodeError("the hf-assisted peer runs on the torch backend (--backend torch)")
    if {"llama.cpp", "llama.cpp-pld", *SERVER_PEERS} & set(methods) and engine.target.gguf_path is None:
        raise SpecDecodeError(
            "the llama.cpp peers need the target on the llama.cpp backend (a GGUF model, --backend llama.cpp or auto)"
        )
    if "llama-server-draft" in methods and engine.draft_model.lm.gguf_path is None:
        raise SpecDecodeError("peer llama-server-draft needs the draft on the llama.cpp backend (a GGUF model)")


def run_bench(
    engine: Engine,
    prompts: list[dict],
    methods: list[str],
    *,
    gamma: int = DEFAULT_GAMMA,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int | None = 0,
    progress: bool = True,
    tree: dict | None = None,
    llama_server: str | None = None,
    log_dir: str | Path = "bench-out/logs",
) -> dict:
    """tree: tree_width/tree_depth/tree_nodes for method tree (unset: chosen by its cost model). llama_server:
    the binary the llama-server peers launch (default: the cached build), its logs in log_dir."""
    greedy, tree = temperature == 0, tree or {}
    costs = engine.tree_costs()  # the measured T(k)/T(1) curve and draft cost, shown next to the speed table
    peers = _make_peers(engine, methods, llama_server, log_dir)
    # with an engine history, every method remembers only its own earlier outputs (never the text another
    # method wrote for the same prompt), and the warm-up leaves none
    history = engine.history
    histories = {m: History(history.max_tokens) if history is not None else None for m in methods}
    engine.history = None
    rows = []
    reuse = PeerAnswers(greedy and history is None)
    prompts = reuse.order(prompts)
    runs = sum(len(p.get("turns") or [0]) for p in prompts) * len(methods)
    bar = tqdm(total=runs, desc="bench", unit="run", disable=not progress)
    try:
        # warm-up (excluded): first calls pay for allocations and kernel selection
        for m in methods:
            _run_one(engine, {**prompts[0], "turns": None}, m, gamma, 8, temperature, seed, tree, peers)
        for i, p in enumerate(prompts):
            # interleaved, prompt by prompt, each prompt's round starting one method later: whichever runs first
            # decodes slower (measured: docs/results/notes.md#code-order), so no method keeps the first place
            for m in methods[i % len(methods) :] + methods[: i % len(methods)]:
                engine.history = histories[m]
                rows += _turns(
                    p,
                    m,
                    bar,
                    lambda run, m: reuse(
                        run, m, lambda: _run_one(engine, run, m, gamma, max_new_tokens, temperature, seed, tree, peers)
                    ),
                )
    finally:
        engine.history = history
        close_peers(peers)
    bar.close()
    return summarize(
        rows,
        methods,
        gamma=gamma,
        greedy=greedy,
        config=dict(
            gamma=gamma,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            prompts=len(prompts),
            methods=methods,
            device=str(engine.target.device),
            backend=engine.backend,
            target=engine.target.name,
            draft=engine.draft_model.lm.name if engine.draft_model else None,
            dtype=str(engine.target.dtype).replace("torch.", ""),
            draft_dtype=str(engine.draft_model.lm.dtype).replace("torch.", "") if engine.draft_model else None,
            threads=engine.target.threads,
            torch_threads=torch.get_num_threads(),
            tree=tree,
            cpu=cpu_description(),
            memory=hugepages_status(),
            draft_quant=engine.draft_model.lm.quant_info if engine.draft_model else None,
            pass_costs=costs.as_dict(),
            datastore=str(engine.datastore.path) if engine.datastore else None,
            datastore_tokens=len(engine.datastore) if engine.datastore else None,
            history_tokens=history.max_tokens if history is not None else 0,
            server_peers={m: " ".join(p.argv) for m, p in peers.items() if hasattr(p, "argv")},
            draft_vocab=len(engine.draft_model.keep)
            if engine.draft_model is not None and engine.draft_model.keep is not None
            else None,
        ),
    )


def _turns(p: dict, m: str, bar, run_one) -> list[dict]:
    """Prompt p under method m (run_one(run, m) -> its result): its rows, one per turn of a conversation, each turn
    after this method's own earlier answers."""
    rows, messages = [], []
    for turn, text in enumerate(p.get("turns") or [p["prompt"]], 1):
        bar.set_postfix_str(f"{p['id']} {m}" + (f" turn {turn}" if p.get("turns") else ""))
        if p.get("turns"):
            messages = messages + [{"role": "user", "content": text}]
            run = {**p, "prompt": messages, "chat": True}
        else:
            run = p
        r = run_one(run, m)
        rows.append(
            {
                "prompt_id": p["id"] + (f"#{turn}" if p.get("turns") else ""),
                "turn": turn,
                "category": p["category"],
                "method": m,
                **r,
            }
        )
        if p.get("turns"):
            messages = messages + [{"role": "assistant", "content": r["text"]}]
        bar.update(1)
    return rows


class PeerAnswers:
    """A greedy peer reads no prediction, so it answers a prompt it has answered before (the same edit sent with
    and without its prediction) as it did then: that row is reused, marked so. Not our plain decoding: with
    --route, a prediction's length can change the engine it runs on."""

    def __init__(self, on: bool):
        self.on, self.answered = on, {}

    def order(self, prompts: list[dict]) -> list[dict]:
        """The prompts in file order, except that, when answers are reused, those a peer answers alike (the same
        text, sent with and without a prediction) run one after another: a reused answer is then minutes old, not
        timed half a run earlier on a machine whose speed drifts."""
        if not self.on:
            return prompts
        groups: dict[str, list[dict]] = {}
        for p in prompts:
            groups.setdefault(repr((p.get("turns") or p["prompt"], bool(p.get("chat")))), []).append(p)
        return [p for group in groups.values() for p in group]

    def __call__(self, run: dict, method: str, fresh) -> dict:
        if not self.on or method not in PEERS:
            return fresh()
        key = (method, repr(run["prompt"]), bool(run.get("chat")))
        if key not in self.answered:
            self.answered[key] = fresh()
            return self.answered[key]
        return {**self.answered[key], "reused": True}


def _make_peers(engine, methods: list[str], llama_server: str | None, log_dir) -> dict:
    """The peers that hold a model: llama-server's launched first (a failure stops the run before the rest),
    then llama-cpp-python's; the servers stopped again if anything fails here."""
    peers = make_server_peers(engine, methods, llama_server, Path(log_dir))
    try:
        peers.update(
            {
                m: LlamaPeer(engine, pld=m == "llama.cpp-pld", log_dir=log_dir)
                for m in methods
                if m in ("llama.cpp", "llama.cpp-pld")
            }
        )
    except BaseException:
        close_peers(peers)
        raise
    return peers


def _run_one(engine, p, method, gamma, max_new_tokens, temperature, seed, tree=None, peers=None) -> dict:
    if method in PEERS:
        ids = engine.encode(p["prompt"], p["chat"])
        if method == "hf-assisted":
            r = hf_assisted(engine, ids, gamma, max_new_tokens, temperature, seed)
        else:
            r = peers[method].generate(ids, max_new_tokens, temperature, seed)
        text = engine.decode(r["token_ids"]) if "token_ids" in r else ""
        r.setdefault("ttft_s", None)
        return {
            **r,
            "text": text,
            "tokens_per_second": r["new_tokens"] / r["wall_s"],
            "decode_tokens_per_second": decode_rate(r["new_tokens"], r["wall_s"], r["ttft_s"]),
            "plain_step_s": None,
            "target_forwards": None,
            "drafted": None,
            "accepted": None,
            "rejections": None,
            "mean_accepted_tokens": None,
            "acceptance_rate": None,
            "accepted_per_position": None,
            "drafted_per_position": None,
            "draft_s": None,
            "verify_s": None,
            "tree_depth": None,
            "expected_tokens": None,
            "planned_passes": None,
            "modelled_s": None,
            "strategies": None,
            "sources": None,
        }
    stream = engine.open(
        Request(
            p["prompt"],
            chat=p["chat"],
            method=method,
            gamma=gamma,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            prediction=p.get("prediction"),
            **(tree or {} if has_flag(method, "tree_options") else {}),
        )
    )
    g = stream.run()
    s = g.stats
    return {
        "token_ids": g.token_ids,
        "text": g.text,
        "new_tokens": s.new_tokens,
        "wall_s": s.wall_s,
        "sources": s.sources,
        "engine": s.engine,
        "tokens_per_second": s.tokens_per_second,
        "target_forwards": s.target_forwards,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "rejections": s.rejections,
        "mean_accepted_tokens": s.mean_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "accepted_per_position": s.accepted_per_position,
        "drafted_per_position": s.drafted_per_position,
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "prefill_s": s.prefill_s,
        "ttft_s": s.ttft_s,
        "first_tokens": s.first_tokens,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "catchup_s": s.catchup_s,
        "tree_depth": s.tree_depth,
        "expected_tokens": s.expected_tokens,
        "planned_passes": s.planned_passes,
        "modelled_s": s.modelled_s,
        "plain_step_s": s.plain_step_s,
        "strategies": s.strategies,
        **_against_a_copy(engine, method, stream, g),
    }


def _against_a_copy(engine, method: str, stream, g) -> dict:
    """With a prediction, for the methods that plan on the measured costs: the share of the answer that copies it
    (the generation's accepted_prediction_tokens), the perfect-copy bound of its decoding here and the plan that knows
    the edit points (bench/bound.py); for an answer that copies at least COPIED of it, the perfect copy timed now."""
    prediction_ids = stream.prediction_ids
    if not prediction_ids or not has_flag(method, "uses_cost_model"):
        return {}
    s, costs = g.stats, engine.tree_costs()
    copied = s.accepted_prediction_tokens / len(g.token_ids) if g.token_ids else None
    timed = None
    if copied is not None and copied >= COPIED:
        with engine.lease.held("timing a perfect copy"):
            timed = timed_copy_bound(engine.target, costs, list(stream.prompt_ids), list(g.token_ids))
    return {
        "prediction_copied": copied,
        "copy_bound_tokens_per_second": copy_bound(costs, s.prompt_tokens, s.new_tokens),
        "timed_copy_bound_tokens_per_second": timed,
        "oracle_tokens_per_second": oracle_bound(costs, s.prompt_tokens, list(g.token_ids), list(prediction_ids)),
    }
