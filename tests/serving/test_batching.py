"""Continuous batching (slots.py, backends/batching.py): generations on their own threads share llama.cpp passes;
each one's output is that of the generation alone."""

import threading
import time

import numpy as np
import pytest

from specdecode import Engine
from specdecode.backends.llamacpp.batching import Lockstep, plan_split
from specdecode.errors import SpecDecodeError
from specdecode.slots import Slots
from tiny import byte_tokenizer, tiny_model

PROMPTS = [
    "abcabcabcabc abcabc",
    "the cat sat on the mat; the cat sat on the",
    "hello world",
    "xyz xyz xyz xyz",
    "one two three one two three",
]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tinygguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("batching") / "tiny.gguf", 0, hidden=128)


@pytest.fixture(scope="module")
def engine(gguf):
    from specdecode.backends.llamacpp import LlamaLM

    tok = byte_tokenizer()
    e = Engine(LlamaLM(gguf, threads=1), tok, LlamaLM(gguf, threads=1), tok)
    e.progress = False
    return e


@pytest.mark.parametrize("method", ["autoregressive", "pld", "draft", "tree", "auto"])
def test_greedy_output_with_company_is_the_output_alone(engine, method):
    alone = [engine.generate(p, method=method, max_new_tokens=32).token_ids for p in PROMPTS]
    slots = Slots(engine, 3)
    outs = slots.generate_many(PROMPTS, method=method, max_new_tokens=32)
    assert [o.token_ids for o in outs] == alone
    assert slots.lockstep.rows > slots.lockstep.passes  # passes really carried several generations


def test_mixed_methods_lengths_and_sampling_run_together(engine):
    """Different methods, lengths and sampling settings in the same passes; seeded sampling as alone."""
    jobs = [
        dict(method="autoregressive", max_new_tokens=7),
        dict(method="tree", max_new_tokens=40),
        dict(method="draft", gamma=3, max_new_tokens=25, temperature=0.9, seed=3),
        dict(method="pld", max_new_tokens=30),
    ]
    alone = [engine.generate(p, **kw).token_ids for p, kw in zip(PROMPTS, jobs)]
    slots = Slots(engine, len(jobs))
    out = [None] * len(jobs)

    def go(i):
        out[i] = slots.run(i, PROMPTS[i], **jobs[i]).token_ids

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [len(o) for o in out] == [len(a) for a in alone]
    assert out[0] == alone[0] and out[1] == alone[1] and out[3] == alone[3]


def test_long_prompt_is_read_in_chunks_while_others_decode(engine):
    slots = Slots(engine, 2, prefill_chunk=16)
    # 216 byte tokens: 12 chunks of 16, then the last 24 (<= 1.5 chunks) in one
    long = "lorem ipsum dolor sit amet " * 8
    seen = []
    real = slots.engines[1].target._shared.decode

    def spy(batch, done=None, more=None):
        seen.extend(len(r[0]) for r in batch)
        return real(batch, done, more)

    slots.engines[1].target._shared.decode = spy
    decoding, short = threading.Event(), []

    def decode_short():  # 96 new tokens: it decodes while the long prompt is read
        with slots.generation():
            for piece in slots.engines[0].stream(PROMPTS[0], method="autoregressive", max_new_tokens=96):
                decoding.set()
                short.append(piece)

    t = threading.Thread(target=decode_short)
    t.start()
    assert decoding.wait(60)
    seen.clear()
    out = slots.run(1, long, method="autoregressive", max_new_tokens=8)
    t.join(60)
    assert out.token_ids == engine.generate(long, method="autoregressive", max_new_tokens=8).token_ids
    assert seen.count(16) >= 12 and max(seen) < 100  # the 216-token prompt went in chunks of 16


def test_a_prompt_is_read_whole_while_no_other_generation_decodes(engine):
    """Chunks protect decoding generations' steps: with nobody decoding (alone, or every other live generation
    reading its own prompt) a prompt is read in passes of up to N_BATCH; beside a decoding one, in chunks."""
    from specdecode.backends.llamacpp import N_BATCH

    slots = Slots(engine, 3, prefill_chunk=16)
    lock, slot = slots.lockstep, slots.engines[0].target
    assert slot.feed_step(700) == N_BATCH and slot.feed_step(200) == 200  # nobody live
    with lock.generation(), slot.reading_prompt():
        assert slot.feed_step(200) == 200  # alone
        other, feed, stop = threading.Event(), threading.Event(), threading.Event()

        def live_other():
            with lock.generation():
                other.set()
                feed.wait(10)
                with lock.reading_prompt():  # the other generation reads its prompt now
                    other.set()
                    stop.wait(10)

        t = threading.Thread(target=live_other)
        t.start()
        try:
            assert other.wait(10)
            other.clear()
            assert lock.others_decoding() == 1
            assert slot.feed_step(200) == 16  # beside a decoding generation: a chunk
            assert slot.feed_step(24) == 24 and slot.feed_step(25) == 16  # a rest of <= 1.5 chunks goes whole
            feed.set()
            assert other.wait(10)
            assert lock.others_decoding() == 0 and slot.feed_step(200) == 200  # it reads a prompt too
        finally:
            feed.set()
            stop.set()
            t.join(10)
    with lock.generation():  # a decoding generation's own draft catch-up alone: whole
        assert lock.others_decoding() == 0 and slot.feed_step(200) == 200


def test_a_live_generation_that_stalls_does_not_hang_the_others(engine):
    slots = Slots(engine, 2)
    stalled = threading.Event()

    def idle_live():
        with slots.generation():  # live, but never asks for a pass
            stalled.wait(5)

    t = threading.Thread(target=idle_live)
    t.start()
    try:
        t0 = time.monotonic()
        out = slots.run(0, PROMPTS[0], method="autoregressive", max_new_tokens=8)
        assert len(out.token_ids) == 8 and time.monotonic() - t0 < 4  # each pass waited the guard time at most
    finally:
        stalled.set()
        t.join()


def test_a_failed_pass_fails_its_own_generation_only(engine):
    """One generation's llama_decode call fails (injected) while another's runs beside it: only the calls it
    was in fail, and both slots serve their next requests."""
    slots = Slots(engine, 2)
    with pytest.raises(SpecDecodeError, match="the prompt has"):  # a slot holds less than the model's context
        slots.run(0, "a" * slots.engines[0].target.max_length, method="autoregressive", max_new_tokens=4)
    shared = slots.engines[0].target._shared
    real, calls = shared._decode, [0]

    def flaky(tokens):
        calls[0] += 1
        if calls[0] == 5:
            raise SpecDecodeError("injected failure")
        return real(tokens)

    shared._decode = flaky
    outs = [None, None]

    def go(i):
        try:
            outs[i] = slots.run(i, PROMPTS[i], method="autoregressive", max_new_tokens=24).token_ids
        except SpecDecodeError as e:
            outs[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    shared._decode = real
    assert any(isinstance(o, SpecDecodeError) for o in outs)  # the call failed for those in it
    for i in range(2):  # and each slot is whole for its next request
        assert (
            slots.run(i, PROMPTS[i], method="autoregressive", max_new_tokens=24).token_ids
            == engine.generate(PROMPTS[i], method="autoregressive", max_new_tokens=24).token_ids
        )


def test_a_slot_reads_a_prompt_whole_when_its_chunk_size_changes_midway(engine, monkeypatch):
    """Others join or leave while a slot reads its prompt: its chunk size changes between chunks (16 <-> 512),
    and every token is still read once."""
    from specdecode.backends.llamacpp.batching import LlamaSlot

    sizes = iter([16, 512, 16, 512] * 50)
    monkeypatch.setattr(LlamaSlot, "feed_step", lambda self, left: min(left, next(sizes)))
    slot = Slots(engine, 2).engines[0].target
    text = list(range(1, 200))
    last = slot.forward(text, last_only=True)[-1]
    assert len(slot) == len(text) and slot.ids == text
    from specdecode.backends.llamacpp import LlamaLM

    alone = LlamaLM(engine.target.path, threads=1).forward(text, last_only=True)[-1]
    assert int(last.argmax()) == int(alone.argmax())


def test_plan_split_follows_the_measured_cost():
    flat = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 3.0, 6: 3.1, 7: 3.2, 8: 9.0}  # a kernel that is slow from 5 tokens
    cost = lambda n: flat.get(n, 9.0 + n)  # noqa: E731
    assert plan_split([1, 1, 1, 1], cost) == [4]  # cost: of whole calls (time_calls)
    assert plan_split([2, 2, 2, 2], cost) == [2, 2]  # two passes of 4 beat one of 8
    assert plan_split([1] * 8, lambda n: n) in ([8], [1] * 8) or sum(plan_split([1] * 8, lambda n: n)) == 8
    assert plan_split([300, 300], None) == [1, 1]  # over one llama_decode's batch
    assert plan_split([600], None) == [1]  # a lone pass is never split here (the slot feeds in chunks)


def test_a_prompts_chunk_goes_apart_from_steps_where_mixed_tiles_cost_more():
    from specdecode.backends.llamacpp.split import FA_TILE, mixing

    cost = lambda n: 0.06 + 0.01 * n  # noqa: E731  (a call: 60 ms, and 10 ms a token)
    steps_and_chunk, cells = [1, 1, 1, 128], [1500, 1600, 1700, 1100]
    assert mixing(steps_and_chunk, cells, 5900, 7e-5) == pytest.approx(7e-5 * (5900 - 1100))  # all but the chunk's
    assert plan_split(steps_and_chunk, cost, cells=cells, in_use=5900, per_cell=7e-5) == [3, 1]
    # controls: the same passes go in one call where mixing is free, the cache nearly empty, or the call untiled
    assert plan_split(steps_and_chunk, cost) == [4]
    assert plan_split(steps_and_chunk, cost, cells=cells, in_use=5900, per_cell=0.0) == [4]
    assert plan_split(steps_and_chunk, cost, cells=[3, 3, 3, 130], in_use=139, per_cell=7e-5) == [4]
    untiled = [1, 1, 1, FA_TILE - 4]
    assert mixing(untiled, cells, 5900, 7e-5) == 0.0
    assert plan_split(untiled, cost, cells=cells, in_use=5900, per_cell=7e-5) == [4]
    assert mixing([128], [1100], 5900, 7e-5) == 0.0  # one generation: nothing mixed


def test_shared_context_decode_cuts_by_the_mixing_cost(engine):
    slots = Slots(engine, 2)
    shared = slots.engines[0].target._shared
    a, b = (e.target for e in slots.engines)
    b.forward([(7 * i + 3) % 200 for i in range(150)], last_only=True)  # a text far in: its cells fill the cache

    def calls(per_cell: float) -> int:
        shared.per_cell = per_cell
        chunk = [[(5, k, [a.seq0], k == 79) for k in range(80)], None, None, 1]
        step = [[(9, 150, [b.seq0], True)], None, None, 2]
        made = shared.decode([step, chunk])
        assert chunk[1].shape[0] == 1 and step[1].shape[0] == 1 and chunk[2] is None and step[2] is None
        for s in (a, b):
            shared._lc.llama_memory_seq_rm(shared.mem, s.seq0, 150 if s is b else 0, -1)
        return made

    assert calls(0.0) == 1  # control: mixing free, one call carries both
    assert calls(1.0) == 2  # mixing dear: the chunk's call holds only its own generation


def test_a_prefill_chunk_given_is_what_slots_read_prompts_in(engine):
    slots = Slots(engine, 2, prefill_chunk=300)
    assert slots.prefill_chunk == 300 and all(e.target.prefill_chunk == 300 for e in slots.engines)
    for bad in (0, -5, 2.5, True, "64"):
        with pytest.raises(SpecDecodeError, match="prefill_chunk must be a positive integer"):
            Slots(engine, 2, prefill_chunk=bad)


def test_time_mixing_is_measured_and_cached_with_the_calls(engine):
    import json

    from specdecode.backends.llamacpp.split import time_mixing
    from specdecode.planning.batch import costs_path

    slots = Slots(engine, 2)
    shared = slots.engines[0].target._shared
    raw = json.loads(costs_path(engine.target, 2).read_text())
    assert shared.per_cell == raw["per_cell"] >= 0.0
    steps = []  # the other slot's step positions in the timed calls
    real = shared._decode
    shared._decode = lambda tokens: (steps.extend(t[1] for t in tokens[63:]), real(tokens))[1]
    seconds = time_mixing(shared, context=32, far=128, repeats=1)
    del shared._decode
    assert 32 in steps and 32 + 128 in steps  # timed beside a text 32 and then 160 cells in
    assert 0.0 <= seconds < 0.01 and all(len(s.ids) == 0 for s in shared.slots)  # the slots left empty
    assert time_mixing(Slots(engine, 1).engines[0].target._shared) == 0.0  # one slot: nothing to mix


def test_lockstep_runs_a_thread_outside_any_generation_at_once():
    class Fake:
        def decode(self, batch, done=None, more=None):
            for r in batch:
                r[1] = [len(r[0])]
            return 1

    step = Lockstep()
    assert step.run(Fake(), [1, 2, 3]) == [3]


def test_a_pass_asked_for_during_a_round_joins_it_once_per_generation():
    """A generation that asks for a pass while a round's calls run (a cached prompt's one token, arriving late) has
    it run before the round's longer passes, not after all of them; a generation already served in the round waits
    for the next one (its steps never starve a long prompt's call)."""
    step, order = Lockstep(guard_s=5.0), []

    class Fake:
        def decode(self, batch, done=None, more=None):
            todo, calls = sorted(batch, key=lambda r: len(r[0])), 0
            while todo:
                r = todo.pop(0)
                order.append(r[0][0])
                r[1] = [r[0][0]]
                done([r])
                calls += 1
                end = time.monotonic() + 10
                while r[0][0] == "short" and len(step._queues.get(self, [])) < 2 and time.monotonic() < end:
                    time.sleep(0.01)  # until "late" and "short again" are asked for
                todo = sorted(todo + more(), key=lambda r: len(r[0]))
            return calls

    fake, both = Fake(), threading.Barrier(2)

    def first():
        with step.generation():
            both.wait()
            step.run(fake, ["short"])
            step.run(fake, ["short again"])

    def long():
        with step.generation():
            both.wait()
            time.sleep(0.2)  # asked for last: this thread runs the round, the first one is free to ask again
            step.run(fake, ["long"] * 100)

    def late():
        while "short" not in order:
            time.sleep(0.01)
        with step.generation():
            step.run(fake, ["late"])

    threads = [threading.Thread(target=f) for f in (first, long, late)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert order == ["short", "late", "long", "short again"]


def test_each_call_hands_its_passes_back_as_soon_as_it_ends():
    """A short pass cut into the first call goes back to its generation while a long prompt's call still runs
    (a short prompt's first token does not wait for a long one read in the same step)."""
    step, release, got = Lockstep(guard_s=5.0), threading.Event(), {}

    class Fake:
        def decode(self, batch, done=None, more=None):
            batch.sort(key=lambda r: len(r[0]))  # as SharedContext.decode: the shortest first
            batch[0][1] = ["short"]
            done(batch[:1])
            assert release.wait(10)  # the long call runs until the short pass's thread has its rows
            for r in batch[1:]:
                r[1] = ["long"]
            done(batch[1:])
            return 2

    def go(name, tokens, later):
        with step.generation():
            live.wait()
            time.sleep(later)  # the short pass waits for the other live generation's, whose thread runs the call
            got[name] = step.run(fake, tokens)

    fake, live = Fake(), threading.Barrier(2)
    short = threading.Thread(target=go, args=("short", [1], 0.0))
    long = threading.Thread(target=go, args=("long", [1] * 100, 0.2))
    short.start()
    long.start()
    short.join(5)
    try:
        assert got.get("short") == ["short"] and "long" not in got
    finally:
        release.set()
        long.join(10)
    assert got["long"] == ["long"] and step.passes == 2 and step.rows == 2


def test_slots_need_a_backend_that_batches_and_no_exact_mode(gguf):
    tok = byte_tokenizer()
    with pytest.raises(SpecDecodeError, match="needs the llama.cpp backend"):
        Slots(Engine(tiny_model(0), tok), 2)
    from specdecode.backends.llamacpp import LlamaLM

    with pytest.raises(SpecDecodeError, match="exact mode runs one generation at a time"):
        Slots(Engine(LlamaLM(gguf, threads=1, exact=True), tok, exact=True), 2)
    with pytest.raises(SpecDecodeError, match="positive integer"):
        Slots(Engine(LlamaLM(gguf, threads=1), tok), 0)
    with pytest.raises(SpecDecodeError, match="at most"):
        Slots(Engine(LlamaLM(gguf, threads=1), tok), 200)


def test_costs_in_company_are_what_a_pass_adds():
    from specdecode.planning.batch import BatchPricing
    from specdecode.planning.costs import CostModel

    table = {1: 0.079, 2: 0.119, 4: 0.181, 8: 0.462}  # Zen 3's T(k): a pass of 8 takes a slower kernel
    company = [0]
    costs = BatchPricing(CostModel(table, {1: 0.03, 2: 0.04}), lambda: company[0])
    assert costs.at(128).t(1) == pytest.approx(0.079)  # alone: the table
    company[0] = 3
    now = costs.at(128)
    assert now.t(1) == pytest.approx(0.181 / 4)  # its share of a call of 4 plain steps
    assert now.t(2) == pytest.approx(0.462 / 4)  # as if every generation added one guess: the slow 8-token kernel
    assert now.t(5) / now.t(1) > 5  # 4 guesses push the pass to the slow kernel: dearer per token than plain
    xeon = BatchPricing(CostModel({1: 0.062, 2: 0.097, 3: 0.122, 4: 0.114, 6: 0.172}), lambda: 2).at(128)
    assert xeon.t(1) == pytest.approx(0.122 / 3) and xeon.t(2) == pytest.approx(0.172 / 3)  # not C(4) - C(3) < 0
    assert now.d(1) == pytest.approx(0.03) and now.d(2) == pytest.approx(0.04)  # the draft's passes: alone


def test_a_guess_in_company_pays_whatever_the_others_do():
    """Zen 4, calls over 8 slots (ms, measured): a call of 16 tokens is cheaper than one of 12-15, and 8 plain rows go
    cheapest as two calls of 4. As a share of a call where every slot guessed too, 3 guesses looked cheap (C(32) / 8);
    beside the others' plain rows they make a call of 11 (real calls of 10-14 tokens: 1.3-1.6x the plain rows)."""
    from specdecode.planning.batch import BatchPricing
    from specdecode.planning.costs import CostModel

    zen4 = {
        1: 33.4,
        2: 57.9,
        3: 81.6,
        4: 99.4,
        5: 124.3,
        6: 144.3,
        7: 171.6,
        8: 223.3,
        9: 242.6,
        10: 257.0,
        11: 282.1,
        12: 291.9,
        13: 315.4,
        14: 323.2,
        15: 344.9,
        16: 289.7,
        20: 359.5,
        24: 411.4,
    }
    calls = CostModel({k: v / 1000 for k, v in zen4.items()})
    now = BatchPricing(CostModel({1: 0.035, 2: 0.07, 4: 0.13}), lambda: 7, calls).at(128)
    plain = 2 * 0.0994 / 8
    assert now.t(1) == pytest.approx(plain)  # 8 plain rows: two calls of 4, as plan_split cuts them
    assert now.t(4) == pytest.approx(plain + (0.1243 + 0.1443) - 2 * 0.0994)  # 11 tokens cut 5 + 6, less the 8 rows
    assert now.t(4) > 3.7 * now.t(1)  # 3 guesses accepted at 0.95 each (3.7 tokens expected) no longer pay
    share = BatchPricing(CostModel({1: 0.035}), lambda: 7, calls)._cut(calls)(32) / 8
    assert share < 2.8 * plain < now.t(4)  # the share price alone said they did
    solo = BatchPricing(CostModel({1: 0.035, 2: 0.07}), lambda: 0, calls).at(128)
    assert solo.t(2) == 0.07  # alone: the generation's own table


def _first_token_law(engine, prompt, params):
    from specdecode.backends.llamacpp import LlamaLM
    from specdecode.sampling import probs_from_logits

    alone = LlamaLM(engine.target.path, threads=1)
    ids = engine.encode(prompt)
    return probs_from_logits(alone.forward(ids, last_only=True)[-1], params).numpy()


def _sampled_first_tokens(slots, prompts, n):
    outs = slots.generate_many(prompts * n, method="draft", gamma=2, max_new_tokens=3, temperature=1.0, top_k=4)
    return [o.token_ids[0] for o in outs]


@pytest.mark.stat
def test_sampled_law_with_company_is_the_targets(engine):
    """2 x 10^4 speculative generations (draft chains, top-k 4), 3 at a time, two prompts interleaved: each
    prompt's first token follows the target's law (p <= 1e-6 fails). What batching could break is which rows a
    generation reads (the verifier's law itself has the 10^5-sample tests of test_lossless_engine): the negative
    control hands rows to the wrong generations and must fail. ~5 ms per generation: 2 x 10^4 keeps it ~2 min."""
    from helpers import gof_pvalue
    from specdecode.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=4)
    a, b = PROMPTS[0], PROMPTS[1]
    laws = {a: _first_token_law(engine, a, params), b: _first_token_law(engine, b, params)}
    assert abs(laws[a] - laws[b]).sum() > 0.5  # the two prompts' laws differ: a mix-up would show
    slots = Slots(engine, 3)
    n = 10_000
    firsts = _sampled_first_tokens(slots, [a, b], n)
    for k, prompt in enumerate((a, b)):
        counts = np.bincount(firsts[k::2], minlength=laws[prompt].size)
        assert gof_pvalue(counts, laws[prompt]) > 1e-6

    # negative control: each llama_decode call hands its rows to the generations in reverse order
    shared = slots.engines[0].target._shared
    real = shared.decode

    def swapped(batch, done=None, more=None):
        made = real(batch)  # without done or more: every row stays here until the swap
        rows = [r[1] for r in batch]
        if len({None if x is None else x.shape for x in rows}) == 1:
            for r, x in zip(batch, rows[::-1]):
                r[1] = x
        return made

    shared.decode = swapped
    try:
        firsts = _sampled_first_tokens(slots, [a, b], 5_000)
    finally:
        shared.decode = real
    pvalues = [gof_pvalue(np.bincount(firsts[k::2], minlength=laws[p].size), laws[p]) for k, p in enumerate((a, b))]
    assert min(pvalues) < 1e-6


def test_server_with_slots_answers_concurrent_streams_as_alone(engine):
    """create_app(slots=...): 6 streamed requests at once over 3 slots (completion and chat, different methods and
    lengths): every answer equals the same request alone, and the generations really ran together."""
    import asyncio

    import httpx

    from helpers import LiveServer
    from specdecode.server import create_app

    slots = Slots(engine, 3)
    live = LiveServer(create_app(engine, model_id="tiny", method="pld", gamma=2, slots=slots))
    url = live.url
    reqs = [
        (
            "completions",
            dict(prompt=p, max_tokens=8 + 4 * i, speculation={"method": ["pld", "autoregressive", "tree"][i % 3]}),
        )
        for i, p in enumerate(PROMPTS)
    ]
    reqs.append(("chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=12)))
    # max_tokens: the slot's room
    reqs.append(("chat/completions", dict(messages=[{"role": "user", "content": "bye"}])))

    async def one(client, path, body):
        text = ""
        async with client.stream(
            "POST", f"{url}/v1/{path}", json={"model": "tiny", "stream": True, "temperature": 0, **body}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    import json

                    choice = json.loads(line[6:])["choices"]
                    if choice:
                        text += choice[0].get("text") or (choice[0].get("delta") or {}).get("content") or ""
        return text

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, path, body) for path, body in reqs))

    try:
        rows_before = slots.lockstep.rows
        got = asyncio.run(all_at_once())
        assert slots.lockstep.rows - rows_before > 0 and slots.lockstep.rows > slots.lockstep.passes
    finally:
        live.stop()
    assert got[-1]  # a request without max_tokens runs to its slot's room
    for (path, body), text in zip(reqs[:-1], got):
        spec = body.get("speculation", {})
        if path == "completions":
            alone = engine.generate(
                body["prompt"], method=spec.get("method", "pld"), gamma=2, max_new_tokens=body["max_tokens"]
            )
        else:
            alone = engine.generate(body["messages"], method="pld", gamma=2, max_new_tokens=body["max_tokens"])
        assert text == alone.text


def test_call_costs_are_measured_once_per_machine_and_cut_the_calls(engine, monkeypatch):
    import json

    from specdecode.backends.llamacpp import N_BATCH
    from specdecode.backends.llamacpp.batching import SharedContext
    from specdecode.planning.batch import CALLS_FORMAT, costs_path

    slots = Slots(engine, 2)
    raw = json.loads(costs_path(engine.target, 2).read_text())
    assert raw["format"] == CALLS_FORMAT
    table = {int(k): v for k, v in raw["calls"].items()}
    assert {1, 2, 3, 4, 8, 32, 64, 128, 256} <= set(table) and all(v > 0 for v in table.values())
    assert slots.prefill_chunk == N_BATCH  # one llama_decode call a chunk, the others' steps between calls
    assert all(e.target.prefill_chunk == slots.prefill_chunk for e in slots.engines)
    assert slots.engines[0].target._shared.cost(3) == pytest.approx(table[3])  # what plan_split reads

    def never(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(SharedContext, "time_calls", never)
    again = Slots(engine, 2)  # read from the cache
    assert again.calls.target == slots.calls.target
    path = costs_path(engine.target, 2)  # a table of an older format (measured before the compute thread): again
    path.write_text(json.dumps({str(k): v for k, v in table.items()}))
    with pytest.raises(AssertionError, match="measured again"):
        Slots(engine, 2)


def test_the_calls_table_learns_what_calls_take_and_the_prices_follow():
    """Xeon, 8 slots (ms): the table timed 9 tokens at 218 beside 210 for 8 plain rows, and a lookup guess looked
    cheap; served calls of 9 took ~228 (longer texts). Once the table learns that, the guess is priced at what it
    adds; before an update (every LEARN_EVERY calls) the prices stay as they were."""
    from specdecode.planning.batch import LEARN_EVERY, BatchPricing, CallCostTracker
    from specdecode.planning.costs import CostModel

    xeon = {1: 59.2, 2: 96.8, 4: 114.7, 7: 190.5, 8: 210.2, 9: 217.7, 10: 234.7, 12: 246.8, 16: 247.3, 32: 422.9}
    calls = CostModel({k: v / 1000 for k, v in xeon.items()})
    costs = BatchPricing(CostModel({1: 0.065, 2: 0.1}), lambda: 7, calls)
    guess = costs.at(300).t(2) - costs.at(300).t(1)
    assert guess == pytest.approx(0.2177 - 0.2102)  # what the 9-token call adds, as timed
    learned = CallCostTracker(calls)
    for _ in range(LEARN_EVERY - 1):
        learned.observe(9, 0.228)
        learned.observe(40, 1.0)  # a prompt's chunk: not a decoding size, left as measured
    assert calls.target[9] == pytest.approx(0.2177) and costs.at(300).t(2) - costs.at(300).t(1) == pytest.approx(guess)
    learned.observe(9, 0.228)  # the LEARN_EVERY-th decoding call: the table and the prices move
    assert calls.target[9] == pytest.approx(0.228, abs=1e-6) and calls.target[32] == pytest.approx(0.4229)
    assert costs.at(300).t(2) - costs.at(300).t(1) == pytest.approx(0.228 - 0.2102, abs=1e-6)


def test_served_calls_are_observed_by_the_slots_table(engine):
    slots = Slots(engine, 2)
    seen = []
    shared = slots.engines[0].target._shared
    learn = shared.observe
    shared.observe = lambda m, s: (seen.append((m, s)), learn(m, s))
    before = slots.lockstep.passes
    slots.generate_many(PROMPTS[:2], method="autoregressive", max_new_tokens=8)
    assert seen and len(seen) == slots.lockstep.passes - before  # every call of the target's context, once
    assert all(m >= 1 and s > 0 for m, s in seen)


@pytest.mark.parametrize("method", ["lookup", "auto", "tree"])
def test_every_drafter_stays_within_its_slots_tree_node_ids(engine, method, monkeypatch):
    """32 slots hold (256 - 32) / 32 = 7 tree-node ids each: every planned drafter's tree (the draft model's
    expansion too) fits in them, on repetitive prompts whose lookup guesses would grow bigger trees."""
    from specdecode.backends.llamacpp.batching import LlamaSlot

    widest = []
    tree_pass = LlamaSlot._tree_pass

    def spy(self, new_ids, parents, n_trunk, last_only):
        widest.append((len(new_ids) - n_trunk, self.max_tree_nodes))
        return tree_pass(self, new_ids, parents, n_trunk, last_only)

    monkeypatch.setattr(LlamaSlot, "_tree_pass", spy)
    from specdecode.planning.costs import CostModel

    slots = Slots(engine, 32, cells=32 * 512)
    flat = CostModel({n: 0.01 for n in (1, 2, 4, 8, 16, 32, 64)}, {n: 0.001 for n in (1, 2, 4, 8, 16, 32, 64)})
    for e in slots.engines:  # passes priced flat: every guess pays, so trees grow as big as they may
        e.costs = flat
    prompts = [f"{w} {w} {w} {w} {w} {w} {w}" for w in ("abc def", "the cat sat", "one two three", "xyz q")] * 2
    outs = slots.generate_many(prompts, method=method, max_new_tokens=48)
    assert all(o.stats.new_tokens > 0 for o in outs)
    assert widest and max(n for n, _ in widest) <= 7 and {cap for _, cap in widest} == {7}


def test_a_slots_share_of_tree_node_ids_leaves_a_copys_chain_its_depth(engine):
    """A followed copy's chain runs on the committed text (no tree-node ids): a slot's cap bounds trees, not it;
    exact mode's pass sizes (limit) still bound both."""
    from specdecode.methods import DraftRequest
    from specdecode.planning.tree import MAX_COPY_DEPTH
    from specdecode.sampling import SamplingParams

    slots = Slots(engine, 32, cells=32 * 512)
    e = slots.engines[0]
    request = DraftRequest(4, SamplingParams(), None, None, None, 64, None, tuple(range(40, 120)), None)
    for method in ("lookup", "auto", "tree"):
        d = e.drafter(method, request)
        assert d.max_nodes <= 7 and d.copy_depth == MAX_COPY_DEPTH and d.depth_cap == MAX_COPY_DEPTH
        d.limit(3, chains_only=True)
        assert d.max_nodes == d.copy_depth == 3


def test_a_server_on_slots_checks_requests_against_what_a_slot_holds(engine):
    """Each slot holds 256 cells less its tree-node ids (129 tokens) while the model's context is 512: a prompt or a
    max_tokens past the slot's room is a 400 before anything runs, not a 200 that ends in an error or is cut short."""
    import httpx

    from helpers import LiveServer
    from specdecode.server import create_app

    slots = Slots(engine, 2, cells=2 * 256)
    room = slots.engines[0].target.max_length
    assert room < 200 < engine.target.max_length
    live = LiveServer(create_app(engine, model_id="tiny", method="pld", slots=slots))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:

            def post(**body):
                return client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})

            for stream in (False, True):
                r = post(prompt="ab" * 100, max_tokens=4, stream=stream)
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                assert str(room) in r.json()["error"]["message"]
                r = post(prompt="hello", max_tokens=room, stream=stream)
                assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = post(prompt="hello", max_tokens=room - 5)  # what fits runs to the end asked for
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= room - 5
    finally:
        live.stop()


def test_a_server_on_slots_refuses_a_tree_a_slot_cannot_hold_before_answering(engine):
    """4 slots hold (256 - 4) // 4 = 63 tree-node ids each: a request's explicit tree shape past that is a 400 naming
    the field, streamed or not (not a 200 whose stream ends in an error when a slot opens it); one that fits runs."""
    import httpx

    from helpers import LiveServer
    from specdecode.server import create_app

    slots = Slots(engine, 4, cells=4 * 256)
    assert slots.engines[0].target.max_tree_nodes == 63 < engine.target.max_tree_nodes
    live = LiveServer(create_app(engine, model_id="tiny", method="pld", slots=slots))
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:

            def post(stream, **shape):
                body = {
                    "model": "tiny",
                    "prompt": "abcabc",
                    "max_tokens": 4,
                    "stream": stream,
                    "speculation": {"method": "tree", **shape},
                }
                return client.post("/v1/completions", json=body)

            for stream in (False, True):
                for shape, field in (({"tree_nodes": 100}, "tree_nodes"), ({"tree_width": 8}, "tree_width")):
                    r = post(stream, **shape)
                    assert r.status_code == 400 and r.json()["error"]["param"] == f"speculation.{field}", r.text
                    assert "63" in r.json()["error"]["message"]
                r = post(stream, tree_nodes=32, tree_width=4)
                assert r.status_code == 200 and "error" not in r.text
    finally:
        live.stop()


def test_serve_ctx_size_is_each_slots_context_checked_against_memory(tmp_path, monkeypatch):
    """`serve --parallel 2 --ctx-size 6000`: each slot holds 6,000 tokens (not 4,096), the server checks requests
    against that, and a size whose cache would not fit in memory is refused before it is made."""
    pytest.importorskip("llama_cpp")
    from specdecode.cli import main
    from specdecode.server import app as app_module
    from tinygguf import write_tiny_gguf

    target = write_tiny_gguf(tmp_path / "long.gguf", 0, ctx=8192)
    apps = []

    class Recorder:
        def __init__(self, config):
            apps.append(config.app)

        def run(self):
            pass

    monkeypatch.setattr(app_module, "Server", Recorder)
    args = ["serve", "--target", str(target), "--method", "pld", "--port", "0", "--parallel", "2"]
    assert main(args + ["--ctx-size", "6000"]) == 0
    service = apps[-1].state.service
    assert service.context == 6000 and service.cap == 6000
    assert main(args) == 0  # without --ctx-size: 4,096 cells a slot, less its tree-node ids
    assert apps[-1].state.service.context == 4096 - (256 - 2) // 2
    monkeypatch.setattr("specdecode.slots.memory_available", lambda: 1 << 20)
    assert main(args + ["--ctx-size", "8000"]) != 0
