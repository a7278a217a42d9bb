"""Resident memory of a launched server (the load test's memory bound).

`rss_bytes(pid)`: the resident set size (VmRSS) of a process plus every process below it (a server that
forks workers is measured whole; pages shared between them count once per process, as `ps` would sum
them), read with psutil (the `bench` extra). `MemorySampler`: a thread that samples it every
`interval` seconds while the load runs; `result()` gives the RSS before, the peak and the RSS after, in MiB.

`thread_cpu(pid)` / `cpu_split(before, after)`: CPU seconds per thread over a round, split into the busiest
`compute` threads (the decoding threads: both servers run their passes on as many threads as `--threads`) and
all the others (HTTP, event loop, tokenizer, logging). On a machine with as many cores as decoding threads,
every CPU second spent outside the decoding threads is taken from them: the load test reports it per
completion token for every server, so a gap between servers at one stream can be laid at its door or not.
"""

from __future__ import annotations

import threading

MIB = 1024 * 1024


def rss_bytes(pid: int) -> int | None:
    """The RSS of `pid` and all its descendants, in bytes; None where `pid` is gone (or cannot be read)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                pass
        return total
    except psutil.Error:
        return None


class MemorySampler:
    """Samples `read(pid)` (default rss_bytes) on entry, every `interval` s in a daemon thread, and on exit."""

    def __init__(self, pid: int, interval: float = 0.5, read=rss_bytes):
        self.pid, self.interval, self.read = pid, interval, read
        self.before = self.peak = self.after = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = None

    def _take(self) -> int | None:
        value = self.read(self.pid)
        if value is not None:
            self.samples += 1
            self.peak = value if self.peak is None else max(self.peak, value)
        return value

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> MemorySampler:
        self.before = self._take()
        self._thread = threading.Thread(target=self._run, name=f"rss-{self.pid}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._take()

    def result(self) -> dict:
        mib = lambda b: None if b is None else round(b / MIB, 1)  # noqa: E731
        return {
            "rss_before_mib": mib(self.before),
            "rss_peak_mib": mib(self.peak),
            "rss_after_mib": mib(self.after),
            "samples": self.samples,
            "interval_s": self.interval,
        }


TOTAL = -1  # thread_cpu's key for the processes' own totals (threads that ended since count there too)


def thread_cpu(pid: int) -> dict[int, tuple[str, float]] | None:
    """CPU seconds (user + system) of every thread of `pid` and its descendants, by thread id, with each
    thread's name where /proc gives it, and under TOTAL the processes' totals (which keep the time of threads
    that have ended); None where `pid` is gone (or cannot be read)."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return None
    out: dict[int, tuple[str, float]] = {TOTAL: ("(all)", 0.0)}
    for proc in procs:
        try:
            threads, times = proc.threads(), proc.cpu_times()
        except psutil.Error:
            continue
        out[TOTAL] = ("(all)", out[TOTAL][1] + times.user + times.system)
        for t in threads:
            try:
                name = open(f"/proc/{proc.pid}/task/{t.id}/comm").read().strip()
            except OSError:
                name = "?"
            out[t.id] = (name, t.user_time + t.system_time)
    return out


def cpu_split(before: dict | None, after: dict | None, compute: int) -> dict | None:
    """CPU seconds each thread spent between two `thread_cpu` readings (threads that started in between
    count from zero), split into the `compute` busiest and the others; None without both readings."""
    if before is None or after is None:
        return None
    spent = sorted(
        ((cpu - before.get(tid, ("", 0.0))[1], name) for tid, (name, cpu) in after.items() if tid != TOTAL),
        reverse=True,
    )
    spent = [(max(0.0, s), name) for s, name in spent]
    top = sum(s for s, _ in spent[:compute])
    others = sum(s for s, _ in spent[compute:])
    if TOTAL in before and TOTAL in after:  # the whole processes' time less the busiest: ended threads included
        others = max(others, after[TOTAL][1] - before[TOTAL][1] - top)
    return {
        "compute_threads": compute,
        "compute_cpu_s": round(top, 3),
        "other_cpu_s": round(others, 3),
        "busiest": [[name, round(s, 3)] for s, name in spent[: compute + 4]],
    }
