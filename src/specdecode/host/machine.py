"""Facts of this machine and user that several modules need: where the cache lives, the CPU's name and the
memory available.

A leaf: it imports nothing from the package, so costs, models and llamacpp can all read it without an
import cycle."""
from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models, tokenizers and measured costs are kept: $SPECDECODE_CACHE, else
    $XDG_CACHE_HOME/specdecode (default ~/.cache/specdecode)."""
    root = os.environ.get("SPECDECODE_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "specdecode"


def write_json(path: Path, data, indent: int | None = None) -> None:
    """Write a measured table (costs, exact pass sizes, a quantization choice) to the cache atomically: other
    processes read either the old file or the whole new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=indent))
    tmp.replace(path)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_description() -> str:
    """CPU model, logical CPUs and the vector/matrix flags that decide which kernels run: the line a report (bench,
    loadtest, certify) opens with."""
    flags = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    return f"{cpu_name() or 'unknown CPU'}, {os.cpu_count()} logical CPUs, flags: {' '.join(flags) or 'n/a'}"


def memory_available() -> int | None:
    """Bytes the kernel reports as available (None where /proc/meminfo is not there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
