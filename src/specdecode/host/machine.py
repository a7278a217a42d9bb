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


PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2**63 rounded down to a page


def memory_available(proc: Path = PROC, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, or less where a cgroup limits the process (a
    container: the smaller figure counts). None where neither is known."""
    known = [
        b
        for b in (_meminfo_available(proc / "meminfo"), cgroup_available(proc / "self" / "cgroup", cgroup))
        if b is not None
    ]
    return min(known, default=None)


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_available(self_cgroup: Path, root: Path) -> int | None:
    """The least room any cgroup of this process leaves, its own or an ancestor's: the limit (v2 memory.max, v1
    memory.limit_in_bytes) less what the group uses, its inactive file cache counted as free (as MemAvailable counts
    the page cache). None where no group sets a limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controllers == "":  # v2: one unified hierarchy, mounted at root (or root/unified beside v1)
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            files = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        rooms += [r for r in (_group_room(d, *files) for d in _groups(base, path)) if r is not None]
    return min(rooms, default=None)


def _groups(base: Path, path: str) -> list[Path]:
    """The process's group directory under base and each ancestor up to base (a group in a cgroup namespace: base)."""
    parts = [p for p in path.strip().split("/") if p]
    return [base.joinpath(*parts[:k]) for k in range(len(parts), -1, -1) if base.joinpath(*parts[:k]).is_dir()]


def _group_room(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        raw = (group / limit_file).read_text().strip()
        if raw == "max" or int(raw) >= NO_LIMIT:
            return None
        used = int((group / usage_file).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(raw) - used + inactive)
