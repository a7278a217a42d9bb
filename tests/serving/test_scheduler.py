"""The server's worker and queue on their own: no app, no HTTP. Jobs carry fake streams that yield
given deltas, optionally held at a gate, so order, cancellation and deadlines are under control."""

import asyncio
import threading
import time

import pytest

from specdecode.errors import ContextExceeded, Overloaded, SpecDecodeError
from specdecode.server.scheduler import Disconnected, End, Job, Metrics, Worker
from specdecode.stats import Generation, Stats


class FakeStream:
    """What Engine.stream returns, reduced to what the worker uses: iteration, .stats, .result."""

    def __init__(
        self, deltas, gate: threading.Event | None = None, delay: float = 0.0, error: SpecDecodeError | None = None
    ):
        self.deltas, self.gate, self.delay, self.error = list(deltas), gate, delay, error
        self.stats = Stats(method="pld", prompt_tokens=3)
        self.result = None
        self.started = threading.Event()
        self.closed = False

    def __iter__(self):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.error:
            raise self.error
        try:
            for d in self.deltas:
                self.stats.new_tokens += 1
                yield d
                time.sleep(self.delay)
            self.stats.finish_reason = "length"
            self.result = Generation("".join(self.deltas), list(range(len(self.deltas))), self.stats)
        finally:
            self.closed = True

    def stop_when(self, check) -> None:
        self.interrupt = check


class NoEngine:
    """The worker only takes the engine's lock: the jobs bring their streams."""


@pytest.fixture
def worker():
    w = Worker(NoEngine(), max_queue=2, metrics=Metrics("m", "pld", 2))
    yield w
    w.stop()


def generations(w: Worker, reason: str) -> float:
    return w.metrics.generations.labels(finish_reason=reason)._value.get()


async def collect(w: Worker, job: Job, **kw) -> list[tuple]:
    return [e async for e in w.events(job, **kw)]


def test_jobs_run_in_order_and_end_with_their_text(worker):
    async def main():
        streams = [FakeStream([f"{i}a", f"{i}b"], delay=0.05) for i in range(3)]  # each runs 0.1 s at least
        jobs = [Job(s, "completions", 60) for s in streams]
        worker.max_queue = 3
        for j in jobs:
            worker.submit(j)
        return [await collect(worker, j) for j in jobs]

    for i, events in enumerate(asyncio.run(main())):
        assert events[:2] == [("delta", f"{i}a"), ("delta", f"{i}b")]
        kind, end = events[2]
        assert kind == "end" and isinstance(end, End)
        assert (end.text, end.finish_reason, end.prompt_tokens, end.completion_tokens) == (f"{i}a{i}b", "length", 3, 2)
        assert end.speculation["method"] == "pld"
        assert 0.1 * i - 0.01 <= end.speculation["queue_s"] < 0.1 * i + 5  # it waited for the jobs before it
    assert generations(worker, "length") == 3


def test_full_queue_refuses_and_retry_after_counts_the_jobs_ahead(worker):
    async def main():
        gate = threading.Event()
        running = FakeStream(["x"], gate)
        jobs = [
            Job(running, "completions", 60),
            Job(FakeStream(["y"]), "completions", 60),
            Job(FakeStream(["z"]), "completions", 60),
        ]
        worker.submit(jobs[0])
        assert await asyncio.to_thread(running.started.wait, 10)
        worker.submit(jobs[1])
        worker.submit(jobs[2])
        assert worker.busy and worker.queued == 2
        with pytest.raises(Overloaded):
            worker.submit(Job(FakeStream(["w"]), "completions", 60))
        assert worker.retry_after() == 3  # the mean job time starts at 1 s; one running, two waiting
        gate.set()
        return [await collect(worker, j) for j in jobs]

    assert [e[-1][1].text for e in asyncio.run(main())] == ["x", "y", "z"]


def test_cancel_while_waiting_frees_the_place_and_never_runs(worker):
    async def main():
        gate = threading.Event()
        first, second = FakeStream(["a"], gate), FakeStream(["b"])
        a, b = Job(first, "completions", 60), Job(second, "completions", 60)
        worker.submit(a)
        assert await asyncio.to_thread(first.started.wait, 10)
        worker.submit(b)
        worker.cancel(b)
        assert worker.queued == 0
        gate.set()
        await collect(worker, a)
        assert await asyncio.to_thread(worker.wait_idle, 10)
        return second

    assert not asyncio.run(main()).started.is_set()


def test_cancel_while_running_stops_at_the_next_delta(worker):
    async def main():
        stream = FakeStream([str(i) for i in range(1000)], delay=0.005)
        job = Job(stream, "completions", 60)
        worker.submit(job)
        seen = []
        async for kind, value in worker.events(job):
            seen.append(value)
            if len(seen) == 3:
                worker.cancel(job)
                break
        assert await asyncio.to_thread(worker.wait_idle, 10)
        return stream

    stream = asyncio.run(main())
    assert stream.closed and stream.stats.new_tokens < 1000
    assert generations(worker, "cancelled") == 1


def test_a_client_that_goes_away_while_waiting_cancels_its_job(worker):
    async def main():
        gate = threading.Event()
        first = FakeStream(["a"], gate)
        worker.submit(Job(first, "completions", 60))
        assert await asyncio.to_thread(first.started.wait, 10)
        job = Job(FakeStream(["b"]), "completions", 60)
        worker.submit(job)

        async def gone():
            return True

        with pytest.raises(Disconnected):
            await collect(worker, job, disconnected=gone)
        assert worker.queued == 0 and job.cancelled.is_set()
        gate.set()

    asyncio.run(main())


def test_deadlines(worker):
    async def main():
        # running past the deadline: ends early, finish_reason length, "timeout" in the stats
        slow = FakeStream([str(i) for i in range(1000)], delay=0.005)
        events = await collect(worker, _submit(worker, Job(slow, "completions", 0.3)))
        kind, end = events[-1]
        assert kind == "end" and end.finish_reason == "length" and end.speculation["finish_reason"] == "timeout"
        assert 0 < end.completion_tokens < 1000
        # waiting past the deadline: a 503 with Retry-After, and the job is out of the queue
        gate = threading.Event()
        _submit(worker, Job(FakeStream(["a"], gate), "completions", 60))
        waiting = _submit(worker, Job(FakeStream(["b"]), "completions", 0.3))
        events = await collect(worker, waiting)
        gate.set()
        return events

    ((kind, err),) = asyncio.run(main())
    assert kind == "error" and err.status == 503 and err.code == "timeout" and int(err.headers()["Retry-After"]) >= 1
    assert worker.queued == 0 and generations(worker, "timeout") == 2


def _submit(worker: Worker, job: Job) -> Job:
    worker.submit(job)
    return job


def test_keepalive_ticks_only_while_waiting(worker):
    async def main():
        gate = threading.Event()
        first = FakeStream(["a"], gate)
        _submit(worker, Job(first, "completions", 60))
        job = _submit(worker, Job(FakeStream(["b", "c"], delay=0.4), "completions", 60))
        kinds = []
        async for kind, _ in worker.events(job, keepalive_s=0.3):
            kinds.append(kind)
            if kinds.count("wait") == 2:
                gate.set()
        return kinds

    kinds = asyncio.run(main())
    assert kinds[:2] == ["wait", "wait"] and kinds[2:] == ["delta", "delta", "end"]  # none while it runs


def test_engine_error_at_the_start_is_a_400_and_the_worker_goes_on(worker):
    async def main():
        too_long = ContextExceeded("the prompt has 9 tokens; the model's context holds 8", param="prompt")
        bad = await collect(worker, _submit(worker, Job(FakeStream([], error=too_long), "chat", 60)))
        good = await collect(worker, _submit(worker, Job(FakeStream(["ok"]), "completions", 60)))
        return bad, good

    bad, good = asyncio.run(main())
    ((kind, err),) = bad
    assert kind == "error" and err.status == 400 and err.message.startswith("the prompt has 9 tokens")
    assert err.code == "context_length_exceeded" and err.param == "messages"  # the chat's name for the prompt
    assert good[-1][1].text == "ok" and generations(worker, "error") == 1


def test_stop_refuses_the_waiting_jobs(worker):
    async def main():
        gate = threading.Event()
        running = _submit(worker, Job(FakeStream(["a", "b"], gate), "completions", 60))
        waiting = _submit(worker, Job(FakeStream(["c"]), "completions", 60))
        await asyncio.to_thread(lambda: running.stream.started.wait(10))
        stopper = asyncio.create_task(asyncio.to_thread(worker.stop))
        await asyncio.to_thread(lambda: running.cancelled.wait(10))
        gate.set()
        await stopper
        return await collect(worker, running), await collect(worker, waiting)

    running, waiting = asyncio.run(main())
    assert running[-1][0] == "error" and running[-1][1].code == "shutting_down"
    assert [(k, e.code) for k, e in waiting] == [("error", "shutting_down")]


def _silent_stream(max_new_tokens: int, step_s: float = 0.005):
    """A real Engine stream whose steps emit no text (as while a stop string's prefix is held back, or special
    tokens are skipped), step_s per step."""
    from tiny import build_engine  # (conftest's make_engine)

    engine = build_engine(draft=None)
    engine.eos_ids = set()
    engine.decode = lambda ids: ""
    forward = engine.target.forward

    def slow(*args, **kw):
        time.sleep(step_s)
        return forward(*args, **kw)

    engine.target.forward = slow
    return engine.stream("abc", method="autoregressive", max_new_tokens=max_new_tokens)


def test_cancel_and_deadline_are_checked_every_step_not_only_when_text_comes(worker):
    async def main():
        stream = _silent_stream(300)
        job = _submit(worker, Job(stream, "completions", 60))
        assert await asyncio.to_thread(lambda: _wait(lambda: stream.stats.new_tokens >= 3))
        worker.cancel(job)
        t0 = time.monotonic()
        assert await asyncio.to_thread(worker.wait_idle, 30)
        cancelled = (stream.stats.new_tokens, time.monotonic() - t0)
        late = _silent_stream(300)
        events = await collect(worker, _submit(worker, Job(late, "completions", 0.2)))
        return cancelled, late, events

    (tokens, took), late, events = asyncio.run(main())
    assert tokens < 20 and took < 1.0, (tokens, took)  # 300 steps of >= 5 ms: it stopped at the next step
    assert generations(worker, "cancelled") == 1
    kind, end = events[-1]
    assert kind == "end" and end.speculation["finish_reason"] == "timeout" and end.text == ""
    assert 0 < late.stats.new_tokens < 150 and generations(worker, "timeout") == 1


def _wait(cond, timeout=30.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_a_long_prompts_read_stops_between_its_passes_when_interrupted(backend, tmp_path):
    """The server's cancellation and deadline (the stream's interrupt) are asked between the prompt's passes too:
    a client gone during a long prompt's read frees the worker after one pass, not after the whole prompt."""
    from specdecode import Engine
    from tiny import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    if backend == "torch":
        target = tiny_model(0, max_pos=4096)
    else:
        pytest.importorskip("llama_cpp")
        from specdecode.backends.llamacpp import LlamaLM
        from tinygguf import write_tiny_gguf

        target = LlamaLM(write_tiny_gguf(tmp_path / "t.gguf", 0, ctx=4096), threads=1)
    engine = Engine(target, tok)
    prompt = "the quick brown fox jumps over the lazy dog; " * 40  # 1,800 tokens: 4 passes of 512
    asked = []
    for method in ("autoregressive", "pld"):
        stream = engine.stream(prompt, method=method, max_new_tokens=8)
        stream.stop_when(lambda: asked.append(len(engine.target)) or True)  # the client is gone at once
        assert list(stream) == [] and stream.result.text == "" and stream.stats.new_tokens == 0
        assert asked and asked[-1] <= 512 and len(engine.target) <= 512  # one pass read, the rest never
    # negative control: nothing asked to stop, the prompt is read whole and the output is the one alone
    full = engine.stream(prompt, method="autoregressive", max_new_tokens=8)
    full.stop_when(lambda: False)
    assert "".join(full) == engine.generate(prompt, method="autoregressive", max_new_tokens=8).text
