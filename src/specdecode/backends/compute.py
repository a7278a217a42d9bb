"""One thread for every parallel pass in the process.

llama-cpp-python builds llama.cpp with OpenMP, and torch's wheels ship the libgomp it then uses too: a pass (or a
parallel torch op) runs as an OpenMP parallel region whose calling thread is the master of its team, and libgomp
keeps a pool of team threads per master thread for that thread's life. Once it manages more threads than there
are CPUs, its threads stop spinning at barriers and sleep on a futex at each of the graph's many barriers: a
pass led by any thread but the first that ran one (a server's worker, a slot of continuous batching) is slower,
and OMP_WAIT_POLICY or GOMP_SPINCOUNT do not help (measured: docs/results/notes.md#code-compute-thread). So every
llama_decode runs on one long-lived thread, whoever asks for it (`call`; the hand-over is cheap), and where torch
computes beside llama.cpp in one process (a router's torch engine) its generations run there too (`steps_on`).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

from ..host import name_thread

_guard = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pid = -1
_ident = -1  # the compute thread's


def _mark() -> None:
    global _ident
    _ident = threading.get_ident()
    name_thread("sd-llama")


def call(fn, *args):
    """fn(*args) on the compute thread, waited for. On the compute thread itself it runs in place. If the wait is
    interrupted (Ctrl-C), the call in flight still ends before this returns: its context is not touched while
    llama.cpp works on it."""
    global _pool, _pid
    if threading.get_ident() == _ident and os.getpid() == _pid:
        return fn(*args)
    with _guard:
        if _pool is None or _pid != os.getpid():  # a forked child has no compute thread: start its own
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specdecode-llama", initializer=_mark)
            _pid = os.getpid()
        pool = _pool
    future = pool.submit(fn, *args)
    try:
        return future.result()
    except BaseException:
        if not future.done():
            concurrent.futures.wait([future])
        raise


def steps_on(steps):
    """`steps` (a generation's iterator) advanced on the compute thread, each step and the closing: the torch ops
    between passes then share llama.cpp's one OpenMP pool instead of starting a second."""
    it = iter(steps)
    try:
        while True:
            try:
                new = call(next, it)
            except StopIteration:
                return
            yield new
    finally:
        call(it.close)  # the generation's cleanup (lease, cache ownership) on the thread that ran it
