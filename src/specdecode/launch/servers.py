"""The servers that `specdecode loadtest --launch` and `specdecode bench`'s llama-server peers start: each on a
free loopback port, waited for until /health answers 200, then stopped (SIGINT, then SIGKILL after 30 s).

Peers (the load test starts one fresh process per concurrency level c, so that no level inherits caches or output
history from another; loadtest/peers.py measures them):
- `llama-server`: llama.cpp's own server on the same GGUF, `-t/-tb THREADS -np c -kvu -c CTX*c`
  (c slots sharing one unified KV cache of CTX tokens per slot);
- `llama-server-draft`: the same with the draft model, `--spec-type draft-simple -md DRAFT`;
- `llama-server-ngram`: the same with llama.cpp's n-gram speculation, `--spec-type ngram-mod` (`--spec-default`'s);
- `llama-server-ngram-simple`: `--spec-type ngram-simple`, a 4-token lookup drafting up to 16 tokens (copies);
- `llama-server-ngram-simple-64`: the same drafting up to 64 tokens (long copies, on CPUs whose deep passes are cheap);
- `specdecode`: ours, `specdecode serve --target T [--draft D] --threads THREADS`, plus `--parallel c`
  where the server has that flag, and `--ctx-size CTX` where given and the server has it;
- `specdecode-p1`: ours with `--parallel 1` (only where the server has that flag; without it
  `specdecode` already serves one request at a time);
- `llama-cpp-python`: llama-cpp-python's own server (`python -m llama_cpp.server`) on the same GGUF, threads
  and CTX, as a reference: it serves one request at a time behind a global lock. Started with
  `--interrupt_requests False` (its default cuts a running stream off when another request arrives),
  `--logits_all False` (its default keeps every prompt position's logits) and `--use_mlock False`; its
  readiness is /v1/models (no /health) and its requests carry `repeat_penalty: 1.0` (its default, 1.1,
  changes greedy answers).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import SpecDecodeError

PEERS = (
    "llama-server",
    "llama-server-draft",
    "llama-server-ngram",
    "llama-server-ngram-simple",
    "llama-server-ngram-simple-64",
    "specdecode",
    "specdecode-p1",
    "llama-cpp-python",
)
DEFAULT_PEERS = ("llama-server", "llama-server-draft", "specdecode")
DEFAULT_CTX = 4096  # llama-server's KV cells per slot; the context of the single-stream bench peers too
HEALTH = {"llama-cpp-python": "/v1/models"}  # the path a peer answers 200 on once ready (default /health)
REQUEST_EXTRA = {"llama-cpp-python": {"repeat_penalty": 1.0}}  # request fields a peer needs to decode greedily
# what `python -m llama_cpp.server` imports beyond llama-cpp-python's own dependencies (its `server` extra)
LLAMA_CPP_SERVER_MODULES = {
    "llama_cpp": "llama-cpp-python",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "sse_starlette": "sse-starlette",
    "starlette_context": "starlette-context<0.4",
    "pydantic_settings": "pydantic-settings",
}


def llama_cpp_server_missing() -> list[str]:
    """The pip requirements missing for llama-cpp-python's server (empty: it can start)."""
    import importlib.util

    return [req for mod, req in LLAMA_CPP_SERVER_MODULES.items() if importlib.util.find_spec(mod) is None]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(subparsers) -> list[str]:
    """The options `specdecode serve` takes in this checkout (its parser in `subparsers`): --parallel and
    --ctx-size are passed only where they exist."""
    serve = subparsers.choices.get("serve")
    return sorted(o for a in (serve._actions if serve is not None else ()) for o in a.option_strings)


def resolve_gguf(spec: str | None) -> str | None:
    """A built-in model name as its GGUF file in the cache (assembled if needed), a path as itself."""
    if spec is None:
        return None
    from ..backends import BUILTIN, assemble

    if spec in BUILTIN:
        return str(assemble(BUILTIN[spec], progress=False))
    if not spec.endswith(".gguf") or not Path(spec).is_file():
        raise SpecDecodeError(f"llama.cpp's servers need a GGUF file or a built-in model name, got {spec!r}")
    return spec


def peer_argv(
    name: str,
    *,
    port: int,
    slots: int,
    threads: int,
    ctx: int,
    target: str,
    draft: str | None,
    llama_server: str | None,
    serve_flags=(),
    ours_ctx: bool = False,
    extra: list[str] = (),
) -> list[str]:
    """The command line of peer `name` for `slots` concurrent requests on 127.0.0.1:port."""
    if name.startswith("llama-server"):
        if llama_server is None:
            raise SpecDecodeError(
                "llama-server is not built: specdecode loadtest --build-llama-server "
                "(or python scripts/build_llama_server.py), or pass --llama-server PATH"
            )
        argv = [
            llama_server,
            "-m",
            resolve_gguf(target),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-np",
            str(slots),
            "-kvu",
            "-c",
            str(ctx * slots),
            "--no-webui",
        ]
        if name == "llama-server-draft":
            if draft is None:
                raise SpecDecodeError("peer llama-server-draft needs a draft model (--draft)")
            argv += [
                "--spec-type",
                "draft-simple",
                "-md",
                resolve_gguf(draft),
                "-td",
                str(threads),
                "-tbd",
                str(threads),
            ]
        elif name == "llama-server-ngram":
            argv += ["--spec-type", "ngram-mod"]
        elif name.startswith("llama-server-ngram-simple"):
            deep = "64" if name.endswith("-64") else "16"
            argv += [
                "--spec-type",
                "ngram-simple",
                "--spec-ngram-simple-size-n",
                "4",
                "--spec-ngram-simple-size-m",
                deep,
            ]
        elif name != "llama-server":
            raise SpecDecodeError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
        return argv + list(extra)
    if name in ("specdecode", "specdecode-p1"):
        argv = [
            sys.executable,
            "-m",
            "specdecode",
            "serve",
            "--target",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            str(threads),
            "--max-queue",
            str(max(16, 2 * slots)),
        ]
        if draft is not None:
            argv += ["--draft", draft]
        if "--parallel" in serve_flags:
            argv += ["--parallel", str(1 if name == "specdecode-p1" else slots)]
        if ours_ctx and "--ctx-size" in serve_flags:
            argv += ["--ctx-size", str(ctx)]
        return argv + list(extra)
    if name == "llama-cpp-python":  # one sequence: c requests wait for its lock, one at a time
        return [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            resolve_gguf(target),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--n_ctx",
            str(ctx),
            "--interrupt_requests",
            "False",
            "--logits_all",
            "False",
            "--use_mlock",
            "False",
            *extra,
        ]
    raise SpecDecodeError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


class Launched:
    """A server process on 127.0.0.1:port, its output in `log_path`; a context manager that waits for
    `health` (a path) to answer 200 and stops the process on exit."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        log_path: Path,
        ready_timeout: float = 900.0,
        env=None,
        health: str = "/health",
        ours: bool = False,
    ):
        """ours: our own server (it keeps this process's environment, huge pages included); any other is started
        with the environment as the user had it (hugepages.user_env)."""
        from ..host import user_env

        self.argv, self.port, self.log_path, self.health = argv, port, Path(log_path), health
        self.url = f"http://127.0.0.1:{port}"
        self.ready_timeout = ready_timeout
        self.env = {**(os.environ if ours else user_env()), **(env or {})}
        self.proc = None

    def __enter__(self) -> Launched:
        import httpx

        from . import http

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write("$ " + shlex.join(self.argv) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                self._close()
                raise SpecDecodeError(
                    f"server exited with status {self.proc.returncode} before it was ready: {self.tail()}"
                )
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise SpecDecodeError(f"server not ready after {self.ready_timeout:.0f} s: {self.tail()}")
            try:
                if http.get(self.url + self.health, timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._close()

    def _close(self) -> None:
        if getattr(self, "_log", None) is not None and not self._log.closed:
            self._log.close()
