"""`specdecode loadtest --launch`: each peer launched (launch/servers.py: its command line and process) once per
concurrency level, measured with the load client (client.py) and its resident memory and CPU (procmem.py), then
stopped."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from ..errors import SpecDecodeError
from ..launch.servers import HEALTH, REQUEST_EXTRA, Launched, free_port, peer_argv


def measure_peer(
    name: str,
    prompts: list[dict],
    levels: list[int],
    *,
    max_tokens: int,
    requests: int | None,
    timeout: float,
    out_dir: Path,
    argv_kw: dict,
    ready_timeout: float = 900.0,
    rounds: int = 1,
    log=print,
    result: dict | None = None,
) -> dict:
    """Launch peer `name` once per level, measure that level `rounds` times on that process, stop it. Level 1
    (first) gives the solo answers the later levels (and rounds) are checked against. Each level's summary
    carries its round and the server's memory (procmem.MemorySampler: RSS before the round, its peak). `result`:
    one from an earlier call for other levels of the same peer (the levels of several peers interleaved), added to."""
    from .client import measure_server
    from .procmem import MemorySampler, cpu_split, thread_cpu

    cpu: list = []  # the threads' CPU times when a round's load starts (after its warm-up)
    if result is None:
        result = {"levels": [], "mismatches": [], "requests": [], "commands": {}, "solo": {}}
    solo = result["solo"]
    for c in levels:
        port = free_port()
        argv = peer_argv(name, port=port, slots=c, **argv_kw)
        result["commands"][str(c)] = shlex.join(argv)
        log(f"{name}, concurrency {c}: {shlex.join(argv)}")
        started = time.perf_counter()
        try:
            with Launched(
                argv,
                port,
                out_dir / "logs" / f"{name}-c{c}.log",
                ready_timeout,
                health=HEALTH.get(name, "/health"),
                ours=name.startswith("specdecode"),
            ) as srv:
                log(f"  ready in {time.perf_counter() - started:.1f} s")
                for r in range(1, rounds + 1):
                    with MemorySampler(srv.proc.pid) as mem:
                        got = measure_server(
                            srv.url,
                            prompts,
                            [c],
                            max_tokens,
                            requests,
                            timeout,
                            warmup=r == 1,
                            solo=solo,
                            log=log,
                            extra=REQUEST_EXTRA.get(name),
                            on_start=lambda: cpu.append(thread_cpu(srv.proc.pid)),
                        )
                    memory = mem.result()
                    log(
                        f"  round {r}: server RSS {memory['rss_before_mib']} MiB before, "
                        f"{memory['rss_peak_mib']} MiB at peak"
                    )
                    for s in got["levels"]:
                        s.update(
                            round=r,
                            memory=memory,
                            cpu=cpu_split(cpu.pop() if cpu else None, thread_cpu(srv.proc.pid), argv_kw["threads"]),
                        )
                    result["levels"] += got["levels"]
                    result["mismatches"] += [{**m, "round": r} for m in got["mismatches"]]
                    result["requests"] += [{**q, "round": r} for q in got["requests"]]
        except SpecDecodeError as e:
            log(f"  failed: {e}")
            result["levels"].append({"concurrency": c, "failed": str(e)[:2000]})
    return result
