"""The worker: one thread runs the Engine, fed by a bounded first-come-first-served queue of jobs.

The Engine is not thread-safe (one KV cache per model), so every generation runs on this one thread. A job is an
Engine TextStream that the request handler already opened (validated and tokenized) but that has not started. The
worker iterates it and hands each event to the job's asyncio queue (loop.call_soon_threadsafe): ("delta", text) for
each piece of text, then ("end", End) or ("error", a typed SpecDecodeError: errors.py). Worker.events reads them on
the request's side; nothing here knows about HTTP.

Cancellation: a waiting job is taken out of the queue; a running one stops at its next step (the stream's `interrupt`,
checked after every step whether or not it emitted text, and between the passes of the prompt's read). A client that
goes away is noticed within POLL_S, while its events flow too. Deadlines: a job still waiting at its deadline gets a 503
(Worker.events); a running job that passes it ends at its next step with finish_reason "length" ("timeout" in its
speculation stats).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio

from ..errors import (
    ContextExceeded,
    EngineFailed,
    EngineUnavailable,
    Overloaded,
    QueueTimeout,
    ServerFault,
    ShuttingDown,
    SpecDecodeError,
    Unavailable,
)
from ..host import name_thread
from .affinity import slot_for
from .metrics import Metrics
from .protocol import engine_error
from .provenance import Provenance

log = logging.getLogger("specdecode.server")

POLL_S = 0.25  # how often a waiting request checks its client and its deadline
OPENING_AT_ONCE = 2  # requests opened (tokenized) at once on handler threads: more wait, leaving the worker its cores

_ENGINE_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_ENGINE_LOCKS_GUARD = threading.Lock()


def engine_lock(engine) -> threading.Lock:
    """The lock held while `engine` generates. Apps built around the same Engine share it, and code
    that calls the engine directly while a server around it is running must hold it too."""
    with _ENGINE_LOCKS_GUARD:
        lock = _ENGINE_LOCKS.get(engine)
        if lock is None:
            lock = _ENGINE_LOCKS[engine] = threading.Lock()
        return lock


class Disconnected(Exception):
    """The client went away while its request waited for an event."""


@dataclass
class End:
    """The last event of a generation that ran to its end."""

    text: str
    finish_reason: str  # "stop" | "length" (OpenAI's)
    prompt_tokens: int
    completion_tokens: int
    speculation: dict  # Stats.as_dict(), plus queue_s; finish_reason "timeout" when the deadline cut it


def shutting_down() -> ShuttingDown:
    return ShuttingDown("the server is shutting down")


def generation_error(e: SpecDecodeError, endpoint: str, retry_after: int) -> SpecDecodeError:
    """An Engine error raised while a job ran, as the error its client gets, by its class: the request was checked
    when it was opened, so what a generation runs into is the server's, but a prompt longer than a slot's context
    (the client's: 400); a passing fault (the cache full or short of memory, perhaps through other generations
    sharing it) is a 503 with Retry-After; the rest are 500s."""
    if isinstance(e, ContextExceeded):
        return engine_error(e, "messages" if endpoint == "chat" else "prompt")
    if isinstance(e, Unavailable):
        return EngineUnavailable(
            f"the server could not run this generation now ({e.message}); retry later", retry_after=retry_after
        )
    return EngineFailed(f"the generation failed: {e.message}")


class Job:
    """One request's generation: an opened, not yet started TextStream, and the queue its events go to.
    Create it on the event loop that reads its events."""

    def __init__(self, stream, endpoint: str, timeout_s: float):
        self.stream, self.endpoint = stream, endpoint
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()  # set when the client is gone (or the server shuts down)
        self.started = False  # the worker took it out of the queue
        self.shutdown = False
        self.ended = False  # its end or error was pushed
        self.arrival = time.monotonic()
        self.deadline = self.arrival + timeout_s
        # where the client asked for each token's source: the name it may see for each source (provenance.py); its
        # deltas are then (text, entries)
        self.sources: Callable[[str], str] | None = None

    def interrupted(self) -> bool:
        """Whether the running generation must end now: its client is gone, or its deadline passed."""
        return self.cancelled.is_set() or time.monotonic() > self.deadline

    def push(self, event: tuple) -> None:
        """From the worker thread: hand an event to the request's event loop."""
        if event[0] != "delta":
            self.ended = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled.set()


class Worker:
    """The threads that run the engine, fed by a bounded FIFO of jobs: one thread on the engine itself, or with
    `slots` (slots.Slots: continuous batching) one per slot, whose generations share their passes."""

    def __init__(self, engine, max_queue: int, metrics: Metrics, slots=None):
        self.max_queue, self.metrics, self.slots = max_queue, metrics, slots
        self.lock = engine_lock(engine)
        self._engines = [engine] if slots is None else slots.engines
        self._cv = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._idle, self._used = set(), [-math.inf] * len(self._engines)  # workers waiting; when each last ended a job
        self._threads: list[threading.Thread | None] = [None] * len(self._engines)
        self._stopping = False
        self._closed = False  # closed by a shutdown: new jobs are refused until start()
        self._opening = 0  # requests admitted and being opened (tokenized), or waiting to be: they count as queued
        self._openers: anyio.CapacityLimiter | None = None  # OPENING_AT_ONCE (made on the event loop: open)
        self._mean_s = 1.0  # moving average of job durations, for Retry-After
        metrics.queued.set_function(lambda: len(self._waiting))
        metrics.busy.set_function(lambda: len(self._running))

    @property
    def queued(self) -> int:
        with self._cv:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._running)

    @property
    def dead(self) -> bool:
        """A worker thread that was started has ended (a health check fails on it)."""
        with self._cv:
            return any(t is not None and not t.is_alive() for t in self._threads)

    def retry_after(self) -> int:
        """Seconds until a place is likely free: the mean job time, times the jobs ahead."""
        with self._cv:
            ahead = (len(self._waiting) + len(self._running)) / len(self._engines)
        return max(1, min(600, math.ceil(self._mean_s * ahead)))

    def queue_timeout(self) -> QueueTimeout:
        return QueueTimeout(
            "the request waited in the queue longer than the server's timeout", retry_after=self.retry_after()
        )

    # -- the request side ---------------------------------------------------------------------------------------------
    def check_room(self) -> None:
        """Overloaded or ShuttingDown if submit would refuse a job now (checked before a request's expensive work)."""
        with self._cv:
            self._refuse()

    def check_tree(self, **request) -> None:
        """With batch slots, a request's tree shape against a slot's share of tree-node ids (Slots.check_tree)."""
        if self.slots is not None:
            self.slots.check_tree(**request)

    async def open(self, fn: Callable[..., Any], *args) -> Any:
        """fn(*args) on a handler thread, OPENING_AT_ONCE at a time (opening a request: tokenizing it), while the
        request holds a place in the queue: bodies waiting to be tokenized count against max_queue (Overloaded, as a
        full queue), so a burst of big bodies cannot pile up behind the tokenizers."""
        with self._cv:
            self._refuse()
            self._opening += 1
        try:
            if self._openers is None:
                self._openers = anyio.CapacityLimiter(OPENING_AT_ONCE)
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._openers)
        finally:
            with self._cv:
                self._opening -= 1

    def submit(self, job: Job) -> None:
        """Queue the job; Overloaded when max_queue jobs wait already, ShuttingDown once the server is closing."""
        with self._cv:
            self._refuse()
            self._waiting.append(job)
            self._stopping = False  # a server that stopped and starts again (same app) serves again
            self._ensure_thread()
            self._cv.notify_all()

    def _refuse(self) -> None:  # holds _cv (a reentrant lock: retry_after takes it too)
        if self._closed:
            raise shutting_down()
        free = len(self._engines) - len(self._running)  # a request being opened may run at once on a free engine
        if len(self._waiting) >= self.max_queue or len(self._waiting) + self._opening >= self.max_queue + free:
            raise Overloaded(
                f"the server is busy ({self.max_queue} requests waiting); retry later", retry_after=self.retry_after()
            )

    def cancel(self, job: Job) -> None:
        """The client is gone: drop the job if it waits, stop it at its next delta if it runs; a no-op once
        it ended."""
        job.cancelled.set()
        self.withdraw(job)

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue if it is still waiting there (True), else leave it alone."""
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            job.cancelled.set()
            self._cv.notify_all()
            return True

    async def events(
        self, job: Job, disconnected: Callable[[], Awaitable[bool]] | None = None, keepalive_s: float | None = None
    ) -> AsyncIterator[tuple]:
        """The job's events up to and including its end or error. While none comes it checks, every POLL_S,
        whether the client went away (`disconnected`: then the job is cancelled and Disconnected raised) and
        whether the job is still queued at its deadline (then it is withdrawn and a 503 is the last event);
        with keepalive_s, ("wait", None) comes every keepalive_s seconds without an event: while the job waits in the
        queue, and while it runs silent (a long prompt being read)."""
        quiet_since = checked = time.monotonic()
        while True:
            try:  # the queue's own get under a timeout scope: no task per event, as wait_for makes on 3.11
                event = job.events.get_nowait() if job.events.qsize() else None
                if event is None:
                    async with asyncio.timeout(POLL_S):
                        event = await job.events.get()
            except TimeoutError:
                event = None
            if disconnected is not None and time.monotonic() - checked >= POLL_S * (event is not None):
                checked = time.monotonic()  # every POLL_S, also while events flow
                if await disconnected():
                    self.cancel(job)
                    raise Disconnected
            if event is None:
                now = time.monotonic()
                if now > job.deadline and self.withdraw(job):
                    self.metrics.generations.labels(finish_reason="timeout").inc()
                    yield ("error", self.queue_timeout())
                    return
                if keepalive_s is not None and now - quiet_since >= keepalive_s:
                    quiet_since = now
                    yield ("wait", None)
                continue
            quiet_since = time.monotonic()
            yield event
            if event[0] != "delta":
                return

    # -- the worker thread --------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cv:
            self._closed = False
            self._ensure_thread()

    def _ensure_thread(self) -> None:  # holds _cv
        for i, thread in enumerate(self._threads):
            if thread is None or not thread.is_alive():
                self._stopping = False
                self._threads[i] = threading.Thread(
                    target=self._loop, args=(i,), name=f"specdecode-worker-{i}", daemon=True
                )
                self._threads[i].start()

    def stop(self, timeout: float = 10.0) -> None:
        """close(), then wait for the threads to end."""
        end = time.monotonic() + timeout
        for thread in self.close():
            if thread is not threading.current_thread():
                thread.join(max(0.0, end - time.monotonic()))

    def close(self) -> list[threading.Thread]:
        """Shut down without waiting: refuse the waiting jobs and new ones (503), stop the running ones at their
        next step (their streams end with an error event). Returns the threads, which end after that step."""
        with self._cv:
            self._stopping = self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for job in self._running:
                job.shutdown = True
                job.cancelled.set()
            threads = [t for t in self._threads if t is not None]
            self._cv.notify_all()
        for job in waiting:
            job.push(("error", shutting_down()))
        return threads

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._cv:
            while self._running or self._waiting:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _take(self, i: int) -> Job | None:
        """The first waiting job for worker i (under _cv), but one that suits another idle slot better (affinity)."""
        for job in self._waiting:
            if len(self._engines) == 1 or slot_for(job, self._engines, sorted(self._idle | {i}), self._used, i) == i:
                self._waiting.remove(job)
                return job
            self._cv.notify_all()  # wake that slot: it takes the job, being the best for it among the idle
        return None

    def _loop(self, i: int) -> None:
        name_thread(f"sd-worker-{i}")
        engine = self._engines[i]
        while True:
            with self._cv:
                self._idle.add(i)
                while not self._stopping and (job := self._take(i)) is None:
                    self._cv.wait()
                self._idle.discard(i)
                if self._stopping:
                    return
                self._running.append(job)
                job.started = True
            t0 = time.monotonic()
            try:
                if self.slots is None:
                    self._run(job, self.lock)
                else:  # the stream was opened (checked, tokenized) on the engine; it runs on slot i
                    try:
                        job.stream = job.stream.reopen(engine)
                    except SpecDecodeError as e:  # a slot's own limits (its share of the tree-node ids)
                        self._fail(job, engine_error(e, "messages" if job.endpoint == "chat" else "prompt"))
                        continue
                    with self.slots.generation():
                        self._run(job, engine_lock(engine), lambda: self._free(i, job))
            except Exception:  # never let the worker die
                log.exception("generation failed")
                self._fail(job, ServerFault("internal error during generation"))
            finally:
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - t0)
                self._free(i, job)
                if not job.ended and (job.shutdown or not job.cancelled.is_set()):
                    # a job taken, then stopped by a shutdown before it ran: its client still hears why
                    job.push(
                        (
                            "error",
                            shutting_down() if job.shutdown else ServerFault("the generation ended without a result"),
                        )
                    )

    def _fail(self, job: Job, err: SpecDecodeError) -> None:
        """The job's generation failed: its last event, and the failure counted by status and code."""
        self.metrics.generations.labels(finish_reason="error").inc()
        self.metrics.errors.labels(status=str(err.status), code=err.code or "").inc()
        job.push(("error", err))

    def _free(self, i: int, job: Job) -> None:
        """Slot i is done with `job`: idle to the others' slot choice before its client hears the end (the client's
        next turn may come at once, and must find the slot that holds the conversation)."""
        with self._cv:
            if job in self._running:
                self._used[i] = time.monotonic()
                self._running.remove(job)
                self._idle.add(i)
                self._cv.notify_all()

    def _run(self, job: Job, lock: threading.Lock, free=lambda: None) -> None:
        if job.cancelled.is_set():
            return
        start = time.monotonic()
        self.metrics.queue_wait.observe(start - job.arrival)
        if start > job.deadline:
            self.metrics.generations.labels(finish_reason="timeout").inc()
            job.push(("error", self.queue_timeout()))
            return
        parts: list[str] = []
        job.stream.stop_when(job.interrupted)  # checked by the stream after every step
        track = None if job.sources is None else Provenance(job.stream, job.sources)
        with lock:
            gen = iter(job.stream)
            try:
                for delta in gen:
                    if not parts:
                        self.metrics.ttft.observe(time.monotonic() - job.arrival)
                    parts.append(delta)
                    job.push(("delta", delta if track is None else (delta, track.take(delta))))
                    if job.interrupted():
                        break
            except SpecDecodeError as e:  # the prompt against a slot's context, a failed pass, a full cache
                log.warning("generation failed: %s", e)
                self._fail(job, generation_error(e, job.endpoint, self.retry_after()))
                return
            finally:
                gen.close()  # stops the generation loop and times it
        stats = job.stream.stats
        reason = None  # why the generation ended before its end: "cancelled" or "timeout"
        if stats.finish_reason is None:
            reason = "cancelled" if job.cancelled.is_set() else "timeout" if job.interrupted() else None
        finish = reason or ("length" if stats.finish_reason == "length" else "stop")
        self.metrics.record(stats, job.endpoint, job.arrival, finish, ttft_seen=bool(parts))
        if reason == "cancelled":
            if job.shutdown:
                job.push(("error", shutting_down()))
            return
        spec = stats.as_dict()
        if reason == "timeout":
            spec["finish_reason"] = "timeout"
        spec["queue_s"] = start - job.arrival
        result = job.stream.result
        free()
        rest = [] if track is None else track.rest()  # tokens with no text sent (the end of text): theirs too
        if rest:
            job.push(("delta", ("", rest)))
        job.push(
            (
                "end",
                End(
                    text=result.text if result is not None else "".join(parts),
                    finish_reason="length" if finish in ("length", "timeout") else "stop",
                    prompt_tokens=stats.prompt_tokens,
                    completion_tokens=stats.new_tokens,
                    speculation=spec,
                ),
            )
        )
