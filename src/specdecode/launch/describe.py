"""The lines a `specdecode bench`, `loadtest` or `certify` report opens with: the CPU and the flags that decide
its kernels, and huge pages for ours and for the peers started."""
from __future__ import annotations

from pathlib import Path


def hugepages_status() -> str:
    """Huge pages for ours and for the peers started (peers get the user's environment: hugepages.user_env)."""
    from ..host.hugepages import status
    return status() + "; peers started as a user starts them"


def cpu_description() -> str:
    """CPU model and the vector/matrix flags that decide which kernels run."""
    from ..host import cpu_name
    flags = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
                break
    except OSError:
        pass
    import os
    return f"{cpu_name() or 'unknown CPU'}, {os.cpu_count()} logical CPUs, flags: {' '.join(flags) or 'n/a'}"
