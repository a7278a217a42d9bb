"""`specdecode loadtest`: the load benchmark's arguments and command. See client.py (the client and its
statistics), peers.py (the servers it launches, measured; their command lines and processes: launch/servers.py),
report.py (outputs), launch/llama_server.py (the offline build of llama.cpp's own server).

    specdecode loadtest --server http://127.0.0.1:8000[,NAME=URL...] --prompts FILE... --concurrency 1,2,4,8
    specdecode loadtest --launch llama-server,llama-server-draft,specdecode --prompts FILE... [--target T --draft D]
    specdecode loadtest --build-llama-server
    specdecode loadtest --soak MINUTES [--parallel P --concurrency C]   (soak_run.py: load and faults)
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path

from ..checks import positive_int
from ..errors import SpecDecodeError


def add_parser(sub) -> None:
    from ..launch.servers import DEFAULT_PEERS, PEERS, serve_flags

    flags = serve_flags(sub)  # read here: the serve parser is added before this one
    t = sub.add_parser(
        "loadtest",
        help="load benchmark: streamed OpenAI requests at several concurrencies against "
        "servers (running ones, or llama-server and ours launched here)",
    )
    t.add_argument(
        "--server",
        default=None,
        metavar="URL[,NAME=URL...]",
        help="running OpenAI-compatible servers to measure (comma-separated; NAME=URL names one)",
    )
    t.add_argument(
        "--launch",
        default=None,
        metavar="PEERS",
        help=f"servers to start here, one fresh process per concurrency level, on free loopback ports: "
        f"comma-separated from {', '.join(PEERS)} ('default': {','.join(DEFAULT_PEERS)})",
    )
    t.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        metavar="FILE",
        help="JSONL files as for bench: 'prompt' (completion) or 'turns' (chat: the first turn)",
    )
    t.add_argument("--limit", type=int, default=None, help="the first N prompts of each file")
    t.add_argument(
        "--concurrency",
        default="1,2,4,8",
        help="comma-separated concurrency levels (default 1,2,4,8; "
        "1 is added first: the solo answers of the greedy check)",
    )
    t.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default: every prompt once, at least one per client)",
    )
    t.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--launch: run each level's load N times on the same server process (default 1); the "
        "server's peak memory per round shows a leak, and later rounds at concurrency 1 are "
        "checked against the first",
    )
    t.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    t.add_argument("--timeout", type=float, default=900.0, help="seconds one request may take (default 900)")
    t.add_argument("--target", default=None, help="--launch: built-in name or GGUF file (default: the default pair)")
    t.add_argument(
        "--draft", default=None, help="--launch: the draft model (default with the default target: its draft)"
    )
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help="--launch: CPU threads of every server (default: all this process may use)",
    )
    t.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        help="--launch: llama-server's KV cache per slot: -c CTX*slots, shared (-kvu; default 4096; "
        "llama-cpp-python's --n_ctx CTX); given, also our server's --ctx-size (where it has one; "
        "default: the model's context)",
    )
    t.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama-server binary (default: the cached build, then PATH)",
    )
    t.add_argument("--llama-args", default="", help="--launch: extra llama-server arguments (one shell-quoted string)")
    t.add_argument("--ours-args", default="", help="--launch: extra `specdecode serve` arguments")
    t.add_argument(
        "--llama-cpp-python-args",
        default="",
        help="--launch: extra `python -m llama_cpp.server` arguments (peer llama-cpp-python)",
    )
    t.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="--launch: seconds a server may take to answer /health (default 900)",
    )
    t.add_argument(
        "--build-llama-server",
        action="store_true",
        help="build llama.cpp's llama-server and llama-batched-bench from llama-cpp-python's source "
        "package into the cache first, if not built yet (about 11 min on 2 cores)",
    )
    t.add_argument(
        "--llama-src",
        default=None,
        metavar="DIR",
        help="--build-llama-server: an unpacked llama-cpp-python source package (default: pip download it)",
    )
    t.add_argument("--jobs", type=int, default=2, help="--build-llama-server: parallel compile jobs (default 2)")
    from .soak_run import add_soak_args

    add_soak_args(t)
    t.add_argument(
        "--out",
        default="loadtest-out",
        help="directory for loadtest.json, loadtest.md, loadtest.png, logs/ (default loadtest-out)",
    )
    t.set_defaults(serve_flags=flags, run=loadtest)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecDecodeError(f"--concurrency must be comma-separated positive integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise SpecDecodeError(f"--concurrency must be comma-separated positive integers, got {text!r}")
    return [1] + sorted(set(levels) - {1})


def _servers(text: str | None) -> dict[str, str]:
    out = {}
    for item in (x.strip() for x in (text or "").split(",") if x.strip()):
        name, _, url = item.partition("=") if "=" in item.split("://")[0] else ("", "", item)
        if not url.startswith(("http://", "https://")):
            raise SpecDecodeError(f"--server: not an http(s) URL: {url!r}")
        out[name or url.rstrip("/")] = url.rstrip("/")
    return out


def _peers(text: str | None) -> list[str]:
    from ..launch.servers import DEFAULT_PEERS, PEERS

    if not text:
        return []
    names = list(DEFAULT_PEERS) if text.strip() == "default" else [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise SpecDecodeError(f"--launch: unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)}")
    return names


def _prompts(args) -> list[dict]:
    from ..launch.prompts import load_prompts

    rows = []
    for path in args.prompts:
        for row in load_prompts(path, args.limit):
            rows.append({**row, "id": f"{os.path.basename(path)}:{row['id']}"})
    return rows


def loadtest(args) -> int:
    """Run the load benchmark; 0 when it ran (errors and greedy mismatches are reported, not fatal)."""
    from ..host import cpu_description
    from ..launch import llama_server as ls
    from ..launch.describe import hugepages_status
    from ..launch.servers import llama_cpp_server_missing
    from .client import measure_server
    from .report import markdown, write_outputs

    if importlib.util.find_spec("httpx") is None:
        raise SpecDecodeError("`specdecode loadtest` needs httpx, which is not installed: pip install httpx")
    if args.launch and importlib.util.find_spec("psutil") is None:  # the launched servers' memory (procmem)
        raise SpecDecodeError(
            "`specdecode loadtest --launch` needs psutil, which is not installed: "
            'pip install "specdecode[bench]" (from a checkout: pip install -e ".[bench]")'
        )
    if getattr(args, "soak", None) is not None:
        from .soak_run import soak

        return soak(args, _servers(args.server), _prompts(args) if args.prompts else None)
    servers, peers = _servers(args.server), _peers(args.launch)
    levels = _levels(args.concurrency)
    for flag, value in (
        ("--max-tokens", args.max_tokens),
        ("--rounds", args.rounds),
        ("--limit", args.limit),
        ("--requests", args.requests),
    ):
        if value is not None:
            positive_int(flag, value)
    binary = args.llama_server or (str(ls.find_binary()) if ls.find_binary() else None)
    if args.build_llama_server and binary is None:
        binary = str(ls.build(src=args.llama_src, jobs=args.jobs) / "llama-server")
    if not servers and not peers:
        if args.build_llama_server:
            sys.stdout.write(f"llama-server: {binary}\n")
            return 0
        raise SpecDecodeError("nothing to measure: give --server URL and/or --launch PEERS")
    if binary is None and any(p.startswith("llama-server") for p in peers):
        raise SpecDecodeError(
            "llama-server is not built: add --build-llama-server (about 11 min on 2 cores), or pass --llama-server PATH"
        )
    missing = llama_cpp_server_missing() if "llama-cpp-python" in peers else []
    if missing:
        raise SpecDecodeError(
            "peer llama-cpp-python (python -m llama_cpp.server) needs "
            + ", ".join(missing)
            + ": pip install "
            + " ".join(shlex.quote(m) for m in missing)
        )
    if not args.prompts:
        raise SpecDecodeError("--prompts FILE is required")
    prompts = _prompts(args)
    log = lambda msg: (sys.stderr.write(msg + "\n"), sys.stderr.flush())  # noqa: E731
    results = {
        "config": {
            "prompts": args.prompts,
            "n_prompts": len(prompts),
            "limit": args.limit,
            "concurrency": levels,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "temperature": 0.0,
            "argv": shlex.join(sys.argv),
        },
        "cpu": cpu_description(),
        "memory": hugepages_status(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "servers": {},
    }
    for name, url in servers.items():
        log(f"{name} ({url})")
        got = measure_server(url, prompts, levels, args.max_tokens, args.requests, args.timeout, log=log)
        results["servers"][name] = {"url": url, **got}
    if peers:
        _measure_peers(args, peers, prompts, levels, binary, results, log)
    out = write_outputs(results, args.out)
    sys.stdout.write(markdown(results).split("\n## Commands")[0] + f"\nwritten to {out}/\n")
    return 0


def _measure_peers(
    args, peers: list[str], prompts: list[dict], levels: list[int], binary: str | None, results: dict, log
) -> None:
    """--launch: each peer measured at every level (peers.measure_peer), level by level, into
    results["servers"]."""
    from ..backends import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..launch.servers import DEFAULT_CTX
    from .peers import measure_peer

    target = args.target or DEFAULT_TARGET
    draft = args.draft or (DEFAULT_DRAFT if args.target is None else None)
    threads = args.threads or len(os.sched_getaffinity(0))
    flags = getattr(args, "serve_flags", [])
    if "specdecode-p1" in peers and "--parallel" not in flags:
        log(
            "specdecode-p1: skipped (this `specdecode serve` has no --parallel: `specdecode` is already one "
            "request at a time)"
        )
        peers = [p for p in peers if p != "specdecode-p1"]
    results["config"].update(
        target=target,
        draft=draft,
        threads=threads,
        ctx_size=args.ctx_size,
        llama_server=binary,
        serve_parallel_flag="--parallel" in flags,
    )
    # level by level, every peer at a level back to back: a VM's speed drifts within half an hour, so peers measured
    # minutes apart differ by the machine as much as by themselves; each level starts one peer later, so that no
    # peer always goes first (the place in a round is worth a few per cent; measured: docs/results/notes.md#code-order)
    argv_kw = {
        name: dict(
            threads=threads,
            ctx=args.ctx_size or DEFAULT_CTX,
            ours_ctx=args.ctx_size is not None,
            target=target,
            draft=draft,
            llama_server=binary,
            serve_flags=flags,
            extra=shlex.split(
                args.llama_args
                if name.startswith("llama-server")
                else args.llama_cpp_python_args
                if name == "llama-cpp-python"
                else args.ours_args
            ),
        )
        for name in peers
    }
    for k, c in enumerate(levels):
        for name in peers[k % len(peers) :] + peers[: k % len(peers)]:
            results["servers"][name] = measure_peer(
                name,
                prompts,
                [c],
                max_tokens=args.max_tokens,
                requests=args.requests,
                timeout=args.timeout,
                out_dir=Path(args.out),
                argv_kw=argv_kw[name],
                ready_timeout=args.ready_timeout,
                rounds=args.rounds,
                log=log,
                result=results["servers"].get(name),
            )
