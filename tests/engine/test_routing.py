"""The engine that suits the request (routing.py): which engine a request runs on, that it runs whole there, and
`--route` end to end on a tiny GGUF (llama.cpp and torch bf16 from the same file)."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode import Engine, SpecDecodeError
from specdecode.errors import InvalidField
from specdecode.planning.costs import CostModel
from specdecode.routing import Router, flat_ratio, tokens_per_second
from tiny import build_engine, char_tokenizer

# a compute-bound engine (llama.cpp's Q4 on 2 cores): cheap plain steps, dear wide passes, slow prompt reading
STEEP = CostModel({1: 1.0, 2: 1.53, 4: 1.53, 8: 2.97, 16: 3.39, 32: 6.1, 64: 12.2}, {})
# a bandwidth-bound engine (bf16 with AMX): plain steps three times dearer, a 16-token pass about one step
FLAT = CostModel({1: 3.0, 2: 3.0, 4: 3.05, 8: 3.1, 16: 3.2, 32: 3.6, 64: 4.5}, {})


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)


def engine(costs, seed=0):
    return build_engine(seed, tokenizer=char_tokenizer(), costs=costs, progress=False)  # (conftest's make_engine)


@pytest.fixture(scope="module")
def router():
    r = Router.__new__(Router)  # two engines with hand-made costs; no timing
    r.engines = {"steep": engine(STEEP), "flat": engine(FLAT, seed=2)}  # other weights: a pin shows in the text
    r.primary = r.engines["steep"]
    r.read_s = {"steep": 0.12, "flat": 0.03}  # the flat engine reads prompts 4x faster
    r.choices = {"steep": 0, "flat": 0}
    return r


def test_rates_follow_the_pass_costs():
    assert tokens_per_second(STEEP, 128, 0.0) == pytest.approx(1.0)
    assert tokens_per_second(FLAT, 128, 0.0) == pytest.approx(1 / 3)
    # a nearly certain copy: the flat engine's deep chains beat the steep engine's
    assert tokens_per_second(FLAT, 128, 0.95) > tokens_per_second(STEEP, 128, 0.95) > 1.0


def test_pld_is_priced_at_the_depth_it_drafts(router):
    """pld drafts gamma guesses a pass whatever they cost: a copy is priced at chains of gamma + 1 tokens, not at the
    deepest chain the costs would pay for. Gamma 4 costs the flat engine nearly a plain step for 4.5 tokens, so the
    steep one ends first; gamma 16 rides the flat engine's cheap wide passes. auto chooses its depth: the flat one."""
    assert tokens_per_second(FLAT, 128, 0.95, gamma=4) == pytest.approx((1 - 0.95**5) / 0.05 / FLAT.t(5))
    assert tokens_per_second(FLAT, 128, 0.95, gamma=4) < tokens_per_second(FLAT, 128, 0.95)
    old = "".join(f"def f{i}(a, b):\n    return a + {i}\n" for i in range(12))  # 376 tokens, one a character
    prompt = "Rename:\n" + old

    def engine(method, **kw):
        return router.generate(prompt, method=method, max_new_tokens=4, prediction=old, **kw).stats.engine

    assert (engine("pld", gamma=4), engine("pld", gamma=16), engine("auto")) == ("steep", "flat", "flat")


def test_an_edit_with_a_prediction_goes_to_the_flat_engine_and_a_chat_stays(router):
    assert router.choose(1000, 400, 0.95) == "flat"
    assert router.choose(30, 200, 0.0) == "steep"
    # the prediction is what decides the choice: without it the long prompt still decodes plainly on the steep one
    assert router.choose(1000, 400, 0.0) == "steep"


def test_each_request_runs_whole_on_the_chosen_engine(router):
    old = "def add(a, b):\n    return a + b\n" * 3
    prompt = "Rename add to plus:\n" + old * 3  # a long prompt for these models: reading it matters
    out = router.generate(prompt, max_new_tokens=60, prediction=old)
    assert out.stats.engine == "flat"
    alone = router.engines["flat"].generate(prompt, max_new_tokens=60, prediction=old)
    assert out.token_ids == alone.token_ids
    short = router.generate("hi", max_new_tokens=20)
    assert short.stats.engine == "steep"
    assert short.token_ids == router.engines["steep"].generate("hi", max_new_tokens=20).token_ids


def test_the_prompt_and_the_prediction_are_tokenized_once(router, monkeypatch):
    """The router tokenizes them to price the request; the engine it chooses drafts from those tokens."""
    texts = []
    for e in router.engines.values():
        for name in ("encode", "encode_prediction"):
            encode = getattr(e, name)
            monkeypatch.setattr(e, name, lambda x, *a, encode=encode: texts.append(x) or encode(x, *a))
    old = "def add(a, b):\n    return a + b\n"
    prompt = "Rename add to plus:\n" + old * 4
    stream = router.stream(prompt, max_new_tokens=4, prediction=old)
    assert stream.stats.engine == "flat"  # chosen on the ids, then opened on the other engine
    assert sorted(texts) == sorted([prompt, old]) and len(stream.prediction_ids) == len(old)  # a character a token


def test_exact_mode_and_draft_model_methods_stay_on_the_first_engine(router, monkeypatch):
    old = "x = 1\n" * 20
    assert router.generate(old, method="draft", max_new_tokens=10, prediction=old).stats.engine == "steep"
    calls = []
    steep = router.engines["steep"]
    monkeypatch.setattr(
        steep,
        "open",
        lambda encoded: (
            calls.append(encoded.request.exact)
            or Engine.open(
                steep, dataclasses.replace(encoded, request=dataclasses.replace(encoded.request, exact=None))
            )
        ),
    )
    router.stream(old, max_new_tokens=5, prediction=old, exact=True)
    assert calls == [True]  # pinned, and asked for exact mode


def test_the_router_answers_for_its_first_engine(router):
    assert router.tokenizer is router.engines["steep"].tokenizer and router.backend == "steep + flat"
    with pytest.raises(SpecDecodeError):
        Router({})


def test_flat_ratio_is_the_best_timed_ratio_of_a_wide_product_to_a_narrow_one(monkeypatch):
    """On a clock that each product advances by a + b x rows (a spike once: another process): the ratio of the two
    products' fastest repeats, (a + 16 b) / (a + b); a CPU whose matrix units price 16 rows as 1 measures 1."""
    import types

    import torch

    from specdecode import routing

    clock, calls = [0.0], []

    def timed(a, b):
        def matmul(x, w):
            calls.append(x.shape[0])
            clock[0] += a + b * x.shape[0] + (5.0 if len(calls) == 3 else 0.0)  # the first timed repeat: a spike
            return x

        return matmul

    monkeypatch.setattr(routing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed(1.0, 0.5))
    assert flat_ratio(rows=16, d=8, ff=8, repeats=3) == pytest.approx((1.0 + 16 * 0.5) / (1.0 + 0.5))
    assert sorted(set(calls)) == [1, 16] and len(calls) == 2 * (2 + 3 * 8)  # warm-ups, then repeats of 8 products
    monkeypatch.setattr(torch.Tensor, "__matmul__", timed(2.0, 0.0))
    assert flat_ratio(rows=16, d=8, ff=8, repeats=3) == pytest.approx(1.0)


def test_route_end_to_end_on_a_tiny_gguf(tmp_path, monkeypatch):
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "t.gguf", 0)
    monkeypatch.setenv("SPECDECODE_ROUTE_FORCE", "1")  # this machine's bf16 ratio must not decide a test
    both = Router.load(str(gguf), None, progress=False, with_draft=False)
    assert set(both.engines) == {"llama.cpp", "torch"} and both.read_s["torch"] > 0
    for fast, slow in (("torch", "llama.cpp"), ("llama.cpp", "torch")):  # the engine that reads prompts slowly loses
        both.read_s = {fast: 0.0, slow: 10.0}
        out = both.generate("hello hello hello", method="auto", max_new_tokens=8)
        alone = both.engines[fast].generate("hello hello hello", method="auto", max_new_tokens=8)
        assert out.stats.engine == fast and out.token_ids == alone.token_ids and len(out.token_ids) == 8
    with pytest.raises(SpecDecodeError, match="--dtype"):
        Router.load(str(gguf), None, dtype="fp32", progress=False)


def test_a_llama_cpp_generation_beside_a_torch_model_reads_logits_on_one_torch_thread(tmp_path, monkeypatch):
    """With a torch model loaded (--route), torch keeps its threads for that model; a generation on llama.cpp
    runs with one (another would spin on a core llama.cpp's threads need) and gives them back; a generation on
    torch keeps them (the control)."""
    import torch

    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "t.gguf", 0)
    monkeypatch.setenv("SPECDECODE_ROUTE_FORCE", "1")
    both = Router.load(str(gguf), None, progress=False, with_draft=False, threads=2)
    torch.set_num_threads(2)
    seen = {}
    for name, engine in both.engines.items():
        forward = engine.target.forward

        def spy(*args, _name=name, _forward=forward, **kwargs):  # the thread count inside each target pass
            seen.setdefault(_name, set()).add(torch.get_num_threads())
            return _forward(*args, **kwargs)

        monkeypatch.setattr(engine.target, "forward", spy)
        engine.generate("hello hello hello", method="autoregressive", max_new_tokens=4)
        assert torch.get_num_threads() == 2  # given back after the generation
    assert seen == {"llama.cpp": {1}, "torch": {2}}


def test_a_routed_generation_runs_on_the_compute_thread(tmp_path, monkeypatch):
    """libgomp keeps a pool per thread that runs parallel ops, and with more pool threads than CPUs llama.cpp's
    barriers sleep (backends/compute.py): a router runs every step of a generation, torch's passes included, on
    the one compute thread, and closes it there (a stream left early frees its engine). Control: the same engine
    called directly runs its passes on the caller's thread."""
    import threading

    from specdecode.backends import compute
    from tinygguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "t.gguf", 0)
    monkeypatch.setenv("SPECDECODE_ROUTE_FORCE", "1")
    both = Router.load(str(gguf), None, progress=False, with_draft=False)
    seen = {}
    for name, engine in both.engines.items():
        forward = engine.target.forward

        def spy(*args, _name=name, _forward=forward, **kwargs):  # the thread each target pass is asked from
            seen.setdefault(_name, set()).add(threading.get_ident())
            return _forward(*args, **kwargs)

        monkeypatch.setattr(engine.target, "forward", spy)
    worker = compute.call(threading.get_ident)
    for name in both.engines:
        monkeypatch.setattr(both, "choose", lambda *args, _name=name: _name)
        out = both.generate("hello hello hello", method="auto", max_new_tokens=6)
        assert out.stats.engine == name
        stream = both.stream("hello hello", method="auto", max_new_tokens=50)
        chunks = iter(stream)
        next(chunks)
        chunks.close()  # left after its first text
        with both.engines[name].lease.held("a check"):  # the stream was closed: its engine is free again
            pass
    assert seen == {"llama.cpp": {worker}, "torch": {worker}}
    seen.clear()
    both.engines["torch"].generate("hello", method="autoregressive", max_new_tokens=2)
    assert seen == {"torch": {threading.get_ident()}} != {"torch": {worker}}


def test_route_refuses_batching():
    from specdecode.slots import Slots

    r = Router.__new__(Router)
    r.engines, r.primary = {"a": None}, None
    with pytest.raises(SpecDecodeError, match="--route"):
        Slots(r, 2)


def test_the_prompt_read_price_is_the_best_of_several_reads(tmp_path, monkeypatch):
    """One read beside other work (a test run, a build) must not become the price every later request is routed
    by: the best of READ_REPEATS reads is cached; negative control: with one read, the slow one is what is kept."""
    from specdecode import routing

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    e = engine(STEEP)
    clock, reads = [0.0], []
    real_forward = e.target.forward

    def forward(ids, **kw):  # the first read is slow (10 s), the others fast (1 s)
        clock[0] += 10.0 if not reads else 1.0
        reads.append(len(ids))
        return real_forward(ids, **kw)

    monkeypatch.setattr(e.target, "forward", forward)
    monkeypatch.setattr(routing.time, "perf_counter", lambda: clock[0])
    assert routing.read_seconds(e, tokens=50) == pytest.approx(1.0 / 50)
    assert len(reads) == routing.READ_REPEATS >= 2
    # cached
    assert routing.read_seconds(e, tokens=50) == pytest.approx(1.0 / 50) and len(reads) == routing.READ_REPEATS
    monkeypatch.setattr(routing, "READ_REPEATS", 1)
    reads.clear()
    assert routing.read_seconds(e, tokens=49) == pytest.approx(10.0 / 49)


def test_the_engine_chosen_does_not_depend_on_max_new_tokens(router, monkeypatch):
    """The same request cut shorter runs on the same engine (two engines round differently). Without a prediction
    this prompt is priced as plain decoding: a 2-token cap would make its prompt read decide (the flat engine), a
    40-token one its decoding (the steep one), were the cap read."""
    prompt = "x = 1\n" * 34  # 204 tokens
    engines = {cap: router.generate(prompt, max_new_tokens=cap).stats.engine for cap in (2, 40)}
    assert engines == {2: "steep", 40: "steep"}
    # with a prediction the request is priced by the prediction's length, whatever the cap
    seen = []
    monkeypatch.setattr(router, "choose", lambda *args: seen.append(args) or "flat")
    old = "def add(a, b):\n    return a + b\n"
    for cap in (1, 8, 500):
        router.stream("Rename add to plus:\n" + old, max_new_tokens=cap, prediction=old)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2] and seen[0][1] == len(old)


def test_a_request_can_pin_an_engine(router):
    """`engine=` runs the request on that engine (the choice would be the steep one), as if it ran there alone; an
    engine not loaded, or one that cannot run what is asked (exact mode, the draft model), is an error naming it."""
    pinned = router.generate("hi", max_new_tokens=12, engine="flat")
    assert pinned.stats.engine == "flat" and router.generate("hi", max_new_tokens=12).stats.engine == "steep"
    assert pinned.token_ids == router.engines["flat"].generate("hi", max_new_tokens=12).token_ids
    assert pinned.token_ids != router.engines["steep"].generate("hi", max_new_tokens=12).token_ids
    assert router.generate("hi", max_new_tokens=4, engine="steep", method="draft").stats.engine == "steep"
    for kwargs, message in [
        ({"engine": "gpu"}, "engine 'gpu' is not loaded here; the engines are 'steep' and 'flat'"),
        ({"engine": "flat", "method": "draft"}, "engine 'flat' cannot run method 'draft'"),
        ({"engine": "flat", "exact": True}, "engine 'flat' cannot run exact mode"),
    ]:
        with pytest.raises(InvalidField, match="^" + message) as e:
            router.stream("hi", **kwargs)
        assert e.value.param == "engine"  # the server names it speculation.engine


def test_the_table_says_which_methods_the_router_moves(router, monkeypatch):
    from specdecode.methods import METHOD_TABLE

    old = "def add(a, b):\n    return a + b\n" * 3
    prompt = "Rename add to plus:\n" + old * 3
    assert router.generate(prompt, method="pld", max_new_tokens=8, prediction=old).stats.engine == "flat"
    monkeypatch.setitem(METHOD_TABLE, "pld", dataclasses.replace(METHOD_TABLE["pld"], routable=False))
    assert router.generate(prompt, method="pld", max_new_tokens=8, prediction=old).stats.engine == "steep"
