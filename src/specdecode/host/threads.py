"""Threads as the OS sees them: a name that `top -H`, /proc and the load test's per-thread CPU split show."""

from __future__ import annotations

import sys


def name_thread(name: str) -> None:
    """Give the calling thread `name` at the OS level too (Linux: the 15 bytes `top -H`, /proc and the load test's
    per-thread CPU split show); a no-op where the C library has no prctl."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except Exception:  # noqa: BLE001 - a name is a convenience: never let it break the thread that asks
        pass
