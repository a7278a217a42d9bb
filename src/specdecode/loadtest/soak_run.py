"""`specdecode loadtest --soak MINUTES`: a load and fault test that leaves the server running, on loopback only,
bounded in time (MINUTES of load) and in count (--requests), that stops by itself.

Phases, against one `specdecode serve --parallel P` launched here on a free 127.0.0.1 port (or a running server,
--server URL: then no restart and no memory reading):
1. warm-up: the whole mix for a few seconds (every code path once), not counted;
2. idle level: the server's RSS (procmem.rss_bytes, psutil) and its /health and /metrics gauges once it is idle;
3. quiet run: honest requests only, at concurrency C, for a fifth of MINUTES: the latencies to compare with;
4. soak: the whole mix (soak.py) at concurrency C for the rest of MINUTES, with a SIGTERM to the server halfway and
   a new server started on the same port once the old one has exited;
5. idle again: RSS and gauges once the server is idle after the load;
6. greedy check: every finished greedy answer's request sent again, one at a time, to the quiet server.
soak_check.py judges the records and writes the report.
"""

from __future__ import annotations

import asyncio
import re
import signal
import statistics
import time
from pathlib import Path

from .soak import PROMPTS, Traffic, request_key

QUIET_FRACTION = 0.2  # of MINUTES: the quiet run
WARMUP_S = 4.0
IDLE_TIMEOUT_S = 120.0


class Soak:
    """One soak run: `run()` returns everything soak_check needs. launcher(): a context manager
    (launch.servers.Launched) that starts the server and has .url and .proc; None with `url` (a running server: no
    restart, no memory)."""

    def __init__(self, cfg: dict, launcher=None, url: str | None = None, log=print):
        self.cfg, self.launcher, self.log = cfg, launcher, log
        self.url = url
        self.server = None
        self.state = {"generation": 0}
        self.out: dict = {
            "config": cfg,
            "phases": {},
            "restart": None,
            "idle": {},
            "records": [],
            "quiet": [],
            "recheck": [],
            "server_metrics": [],
        }

    def run(self) -> dict:
        if self.launcher is not None:
            self.server = self.launcher(0).__enter__()
            self.url = self.server.url
        try:
            asyncio.run(self._run())
        finally:
            if self.server is not None:
                self.server.__exit__(None, None, None)
        return self.out

    async def _run(self) -> None:
        import httpx

        cfg = self.cfg
        model = cfg.get("model") or (await asyncio.to_thread(_model_of, self.url))
        self.out["model"] = model
        limits = httpx.Limits(max_connections=cfg["concurrency"] + 4, max_keepalive_connections=0)  # one per request
        async with httpx.AsyncClient(timeout=cfg["client_timeout"], limits=limits) as client:
            traffic = Traffic(
                client,
                self.url,
                model,
                seed=cfg["seed"],
                prompts=cfg.get("prompts") or PROMPTS,
                max_tokens=cfg["max_tokens"],
                long_chars=cfg["long_chars"],
                too_long_chars=cfg["too_long_chars"],
                state=self.state,
            )
            minutes_s = cfg["minutes"] * 60
            await self._phase("warmup", traffic, WARMUP_S, None, keep=None, budget=None)
            self.out["idle"]["before"] = await self._idle()
            quiet_s = minutes_s * QUIET_FRACTION
            most = cfg["max_requests"]
            await self._phase(
                "quiet",
                traffic,
                quiet_s,
                "honest",
                keep=self.out["quiet"],
                budget=None if most is None else max(1, int(most * QUIET_FRACTION)),
            )
            soak_s = minutes_s - quiet_s
            half = None if most is None else max(1, int(most * cfg["restart_at"]))
            restart = (
                asyncio.create_task(self._restart_at(soak_s * cfg["restart_at"], half)) if self._can_restart() else None
            )
            await self._phase("soak", traffic, soak_s, None, keep=self.out["records"], budget=most)
            if restart is not None:
                await restart
            self.out["idle"]["after"] = await self._idle()
            self.out["server_metrics"].append(await asyncio.to_thread(_metrics, self.url))
            await self._recheck(client)

    def _can_restart(self) -> bool:
        return self.server is not None and self.cfg["restart_at"] is not None

    async def _phase(
        self, name: str, traffic: Traffic, seconds: float, kind: str | None, keep: list | None, budget: int | None
    ) -> None:
        """`concurrency` clients, each sending its next request as its last one ends, until `seconds` have passed
        or `budget` requests are sent; keep: where the records go (None: dropped)."""
        cfg, t0 = self.cfg, time.perf_counter()
        end, budget = t0 + seconds, [budget]
        records = keep if keep is not None else []

        async def client():
            while time.perf_counter() < end and (budget[0] is None or budget[0] > 0):
                if budget[0] is not None:
                    budget[0] -= 1
                rec = await traffic.next(kind)
                records.append(rec)
                if rec["refused"]:  # the server is restarting: no hammering of a closed port
                    await asyncio.sleep(0.2)

        await asyncio.gather(*(client() for _ in range(cfg["concurrency"])))
        self.out["phases"][name] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "requests": len(records),
            "t_start": t0,
        }
        self.log(f"soak: {name}: {len(records)} requests in {time.perf_counter() - t0:.1f} s")

    async def _restart_at(self, delay: float, after: int | None) -> None:
        """SIGTERM to the server `delay` seconds into the soak (or once `after` requests are sent); once it has
        exited, the same command again on the same port; the times of each step into out["restart"]."""
        end = time.perf_counter() + delay
        while time.perf_counter() < end and (after is None or len(self.out["records"]) < after):
            await asyncio.sleep(0.1)
        self.out["server_metrics"].append(await asyncio.to_thread(_metrics, self.url))
        old, t_term = self.server, time.perf_counter()
        self.log("soak: SIGTERM to the server")
        old.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(old.proc.wait, 60)
        except Exception:  # noqa: BLE001 - past a minute: killed, and said so in the report
            old.proc.kill()
            code = await asyncio.to_thread(old.proc.wait, 30)
            code = f"killed after 60 s (then {code})"
        t_exit = time.perf_counter()
        old.__exit__(None, None, None)
        self.state["generation"] = 1
        self.server = await asyncio.to_thread(lambda: self.launcher(1).__enter__())
        t_ready = time.perf_counter()
        self.out["restart"] = {
            "t_sigterm": t_term,
            "t_exit": t_exit,
            "t_ready": t_ready,
            "exit_code": code,
            "exit_s": round(t_exit - t_term, 2),
            "down_s": round(t_ready - t_term, 2),
        }
        self.log(
            f"soak: the server exited {t_exit - t_term:.1f} s after SIGTERM (status {code}); a new one "
            f"answered {t_ready - t_exit:.1f} s later"
        )

    async def _idle(self) -> dict:
        """Once /health says idle: the server's RSS (median of five readings 0.4 s apart) and its gauges."""
        t0 = time.perf_counter()
        health = None
        while time.perf_counter() - t0 < IDLE_TIMEOUT_S:
            health = await asyncio.to_thread(_health, self.url)
            if health and not health.get("busy") and not health.get("queued"):
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)
        rss = []
        if self.server is not None:
            from .procmem import rss_bytes

            for _ in range(5):
                rss.append(rss_bytes(self.server.proc.pid))
                await asyncio.sleep(0.4)
        rss = [x for x in rss if x is not None]
        return {
            "health": health,
            "waited_s": round(time.perf_counter() - t0, 2),
            "generation": self.state["generation"],
            "rss_mib": round(statistics.median(rss) / (1 << 20), 1) if rss else None,
            "gauges": await asyncio.to_thread(_gauges, self.url),
        }

    async def _recheck(self, client) -> None:
        """Each finished greedy answer's request again, alone (one at a time, the server otherwise idle), at most
        `recheck` distinct requests (the first ones sent)."""
        from .soak_check import finished

        seen: dict[str, dict] = {}
        for rec in self.out["records"] + self.out["quiet"]:
            if "body" in rec and finished(rec):
                seen.setdefault(request_key(rec["body"]) + repr(rec["body"].get("prediction")), rec["body"])
        bodies = list(seen.values())[: self.cfg["recheck"]]
        traffic = Traffic(
            client,
            self.url,
            self.out["model"],
            seed=0,
            prompts=PROMPTS,
            max_tokens=1,
            long_chars=0,
            too_long_chars=0,
            state=self.state,
        )
        t0 = time.perf_counter()
        for body in bodies:
            rec = await traffic._send(body, "recheck")
            rec["key"] = request_key(body) + repr(body.get("prediction"))
            self.out["recheck"].append(rec)
        self.log(f"soak: {len(bodies)} greedy requests again, alone, in {time.perf_counter() - t0:.1f} s")


def _model_of(url: str) -> str:
    from .client import server_model

    return server_model(url)


def _health(url: str) -> dict | None:
    from ..launch import http

    try:
        return http.get(url + "/health", timeout=10).json()
    except Exception:  # noqa: BLE001 - a server that does not answer is not idle
        return None


METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def _metrics(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, {} where it does not answer."""
    from ..launch import http

    try:
        text = http.get(url + "/metrics", timeout=10).text
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line.strip())
        if m and not line.startswith("#"):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def _gauges(url: str) -> dict[str, float]:
    """The gauges of work in progress: queue depth, busy, and any KV cache / cell gauge the server exposes."""
    return {
        k: v
        for k, v in _metrics(url).items()
        if re.search(r"queue_depth|worker_busy|kv|cells", k) and not k.endswith(("_created", "_total"))
    }


def soak_dir(out: str | Path) -> Path:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_soak_args(t) -> None:
    """`specdecode loadtest`'s --soak options (the parser `t`)."""
    k = t.add_argument_group("soak: a load and fault test that leaves the server running (loadtest/soak_run.py)")
    k.add_argument(
        "--soak",
        type=float,
        default=None,
        metavar="MINUTES",
        help="MINUTES of mixed honest and faulty requests at the highest --concurrency against one "
        "`specdecode serve --parallel P` launched here (or --server URL), with a SIGTERM and "
        "restart halfway; judged (soak.md, soak.json in --out); exit status 1 when a criterion fails",
    )
    k.add_argument("--parallel", type=int, default=4, help="--soak: the launched server's --parallel (default 4)")
    k.add_argument(
        "--soak-timeout",
        type=float,
        default=60.0,
        help="--soak: the launched server's --timeout, the deadline of every request (default 60 s)",
    )
    k.add_argument(
        "--soak-restart-at",
        type=float,
        default=0.5,
        help="--soak: when the SIGTERM comes, as a fraction of the soak (default 0.5; 0: none)",
    )
    k.add_argument(
        "--soak-recheck",
        type=int,
        default=100,
        help="--soak: at most this many finished greedy requests sent again alone, one at a time "
        "(default 100: on the default pair on a CPU, about 10 minutes)",
    )
    k.add_argument(
        "--soak-long-chars",
        type=int,
        default=6000,
        help="--soak: characters of the long prompts (disconnects during the prompt's read, deadlines)",
    )
    k.add_argument(
        "--soak-latency-floor-ms",
        type=float,
        default=50.0,
        help="--soak: p99 latencies may also exceed 2x the quiet run's by this much (default 50 ms)",
    )
    k.add_argument(
        "--soak-greedy-tolerance",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="--soak: the share of greedy answers that may differ from the same request alone (default "
        "0; batched passes can break a near-tie of the top two logits otherwise than a pass alone)",
    )
    k.add_argument("--seed", type=int, default=0, help="--soak: the seed of the request mix (default 0)")


def soak(args, servers: dict[str, str], prompts: list[dict] | None) -> int:
    """`specdecode loadtest --soak MINUTES`: 0 when every criterion passed, 1 when one failed. servers: --server as
    cli.py reads it; prompts: --prompts' rows (None: soak.PROMPTS)."""
    import importlib.util
    import os
    import shlex
    import sys

    from ..errors import SpecDecodeError
    from ..host import cpu_description
    from .soak_check import judge, markdown, summary, write_report

    if args.soak <= 0 or args.parallel < 1 or args.max_tokens <= 0 or args.soak_timeout <= 0:
        raise SpecDecodeError("--soak, --parallel, --max-tokens and --soak-timeout must be positive")
    if len(servers) > 1 or (servers and args.launch):
        raise SpecDecodeError("--soak runs against one server: --server URL (running) or none (launched here)")
    if not servers and importlib.util.find_spec("psutil") is None:  # the launched server's memory (procmem)
        raise SpecDecodeError('`specdecode loadtest --soak` needs psutil: pip install "specdecode[bench]"')
    concurrency = max(int(x) for x in args.concurrency.split(",") if x.strip())
    cfg = {
        "minutes": args.soak,
        "concurrency": concurrency,
        "parallel": args.parallel,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "max_requests": args.requests or int(args.soak * 2000),
        "client_timeout": args.timeout,
        "server_timeout_s": args.soak_timeout,
        "restart_at": args.soak_restart_at or None,
        "recheck": args.soak_recheck,
        "long_chars": args.soak_long_chars,
        "too_long_chars": 400_000,
        "drift": 0.05,
        "greedy_tolerance": args.soak_greedy_tolerance,
        "latency_factor": 2.0,
        "latency_floor_s": args.soak_latency_floor_ms / 1000,
        "prompts": prompts,
        "argv": shlex.join(sys.argv),
    }
    log = lambda msg: (sys.stderr.write(msg + "\n"), sys.stderr.flush())  # noqa: E731
    if servers:
        cfg["url"] = next(iter(servers.values()))
        runner = Soak(cfg, url=cfg["url"], log=log)
    else:
        launcher, cfg["command"] = _launcher(args, cfg, os.sched_getaffinity(0))
        runner = Soak(cfg, launcher=launcher, log=log)
    out = runner.run()
    if not servers:  # the launched server has stopped: its target scores where greedy answers parted (soak_ties.py)
        out["ties"] = _score_ties(out, args, log)
    criteria = judge(out)
    cpu = cpu_description()
    folder = write_report(out, criteria, soak_dir(args.out), cpu)
    sys.stdout.write(
        markdown(summary(out, criteria), criteria, cfg, cpu).split("\n## Requests by variant")[0]
        + f"\nwritten to {folder}/\n"
    )
    return 0 if summary(out, criteria)["passed"] else 1


def _score_ties(out: dict, args, log) -> dict:
    from ..backends import DEFAULT_TARGET
    from .soak_check import greedy_partings
    from .soak_ties import score_partings

    parted = greedy_partings(out["quiet"] + out["records"], out["recheck"])[0]
    if not parted:
        return {}
    t0 = time.perf_counter()
    ties = score_partings(parted, args.target or DEFAULT_TARGET, threads=args.threads)
    log(
        f"soak: {len(parted)} greedy answers parted from alone; scored by the target alone in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return ties


def _launcher(args, cfg: dict, cores) -> tuple:
    """(launcher(generation) -> launch.servers.Launched, the command line): `specdecode serve --parallel P
    --timeout T` on one free loopback port, the same port for the server started after the restart."""
    import shlex

    from ..backends import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..launch.servers import DEFAULT_CTX, Launched, free_port, peer_argv

    target = args.target or DEFAULT_TARGET
    draft = args.draft or (DEFAULT_DRAFT if args.target is None else None)
    port = free_port()
    argv = peer_argv(
        "specdecode",
        port=port,
        slots=args.parallel,
        threads=args.threads or len(cores),
        ctx=args.ctx_size or DEFAULT_CTX,
        ours_ctx=args.ctx_size is not None,
        target=target,
        draft=draft,
        llama_server=None,
        serve_flags=getattr(args, "serve_flags", ["--parallel"]),
        extra=["--timeout", str(args.soak_timeout), *shlex.split(args.ours_args)],
    )

    def launcher(generation: int) -> Launched:
        return Launched(
            argv, port, soak_dir(args.out) / "logs" / f"serve-{generation}.log", args.ready_timeout, ours=True
        )

    return launcher, shlex.join(argv)
