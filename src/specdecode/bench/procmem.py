"""Resident memory of a launched server (issue 22: the load test's memory bound).

`rss_bytes(pid)`: the resident set size (VmRSS) of a process plus every process below it (a server that
forks workers is measured whole; pages shared between them count once per process, as `ps` would sum
them). psutil where it is installed, else /proc (Linux). `MemorySampler`: a thread that samples it every
`interval` seconds while the load runs; `result()` gives the RSS before, the peak and the RSS after, in MiB.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

MIB = 1024 * 1024


def _proc_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
        return 0  # a zombie has no VmRSS line
    except (OSError, ValueError):
        return None


def _proc_descendants(pid: int) -> list[int]:
    """Every process below `pid`, from each /proc/N/stat's parent id."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def rss_bytes_proc(pid: int) -> int | None:
    """rss_bytes from /proc alone (Linux); None where `pid` is gone."""
    own = _proc_rss(pid)
    if own is None:
        return None
    return own + sum(_proc_rss(p) or 0 for p in _proc_descendants(pid))


def rss_bytes(pid: int) -> int | None:
    """The RSS of `pid` and all its descendants, in bytes; None where `pid` is gone (or cannot be read)."""
    try:
        import psutil
    except ImportError:
        return rss_bytes_proc(pid)
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
        return {"rss_before_mib": mib(self.before), "rss_peak_mib": mib(self.peak), "rss_after_mib": mib(self.after),
                "samples": self.samples, "interval_s": self.interval}
