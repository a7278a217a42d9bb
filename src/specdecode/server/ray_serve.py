"""The server as Ray Serve replicas: `specdecode serve --ray --replicas N` (or `--autoscale MIN,MAX`), and
`ray_app(...)`, a Serve application for those who compose their own (needs the `ray` extra:
pip install "specdecode[ray]").

Each replica is one Ray actor that loads its own Engine once in its constructor (models, measured pass costs,
exact pass sizes, datastore) and then serves the FastAPI app of `create_app` through `serve.ingress` (built per
replica by `__serve_build_asgi_app__`, the hook Ray Serve calls after the constructor). A replica is ready, and
gets traffic, only once that constructor has returned; `check_health` then fails if its worker thread died.
It reserves `threads` CPUs (`ray_actor_options`) and its models run on exactly that many threads, so replicas
sharing a machine never oversubscribe its cores. Every response carries the replica's id in the header
`x-specdecode-replica`, and its /metrics every sample with the label `replica`.

Faults: when a replica dies mid-request, Ray's HTTP proxy answers a bare 500 "Internal Server Error" if nothing
was sent yet, and drops the connection in the middle of a stream (the openai client: "Connection error.").
`proxy_middlewares`, installed in every proxy by `start` (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in the
controller's environment, inherited by the proxies), turns these into an OpenAI-style 503 with Retry-After (the
openai client retries it by itself), or a final `data: {"error": ...}` event and `data: [DONE]` in a stream that
had begun (the openai client raises APIError). Ray Serve replaces the replica; the others keep serving.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..checks import positive_int
from ..errors import ReplicaLost, SpecDecodeError
from ..methods import DEFAULT_GAMMA, DEFAULT_METHOD

REPLICA_HEADER = "x-specdecode-replica"
PROXY_CALLBACK = "specdecode.server.ray_serve:proxy_middlewares"
APP_NAME = "specdecode"
# Ray Serve's HTTP proxy must pass a readiness check within 5 s (three tries) by default: too short on a busy
# machine (two cores with a build beside them), where serve.start then fails with ActorDiedError. Read by the
# controller, which starts the proxies: set in its environment.
SLOW_MACHINE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
START_TRIES = 2  # serve.start once more after a failure (a proxy that lost a race for the CPU)
MIN_RAY = (2, 60)  # __serve_build_asgi_app__, controller_options (tested with 2.60.0)


def _check_ray():
    try:
        import ray
    except ImportError:
        raise SpecDecodeError(
            'Ray Serve is not installed: pip install "specdecode[ray]" (from a checkout: pip install -e ".[ray]")'
        ) from None
    version = tuple(int(x) for x in ray.__version__.split(".")[:2] if x.isdigit())
    if version < MIN_RAY:
        raise SpecDecodeError(
            f"ray {ray.__version__} is too old for specdecode's replicas; need ray[serve] >= "
            f'{".".join(map(str, MIN_RAY))}: pip install -U "specdecode[ray]"'
        )
    return ray


# -- the replica -------------------------------------------------------------------------------------------------------
class Replica:
    """One replica: an Engine loaded once, and the app of create_app around it (wrapped by `ray_app`)."""

    def __init__(self, load: dict, app: dict, ctx_size: int | None = None):
        from ..engine import Engine
        from .app import create_app, limit_context

        self.replica_id = _replica_id()
        threads = load.get("threads")
        if threads:  # what the engine's own kernels (llama.cpp, torch) and any OpenMP pool may use
            os.environ["OMP_NUM_THREADS"] = str(threads)
        engine = Engine.load(**load, progress=False)
        engine.tree_costs()  # the pass costs any request's method may plan on: measured (once per machine) now
        if ctx_size is not None:  # after measuring, which times passes at long contexts (as `serve --ctx-size`)
            limit_context(engine, ctx_size)
        if load.get("exact"):
            engine.exact_limits()
        self.specdecode_app = create_app(engine, **app)
        tag(self.specdecode_app, self.replica_id)

    def __serve_build_asgi_app__(self):
        return self.specdecode_app

    def check_health(self) -> None:
        if self.specdecode_app.state.worker.dead:
            raise RuntimeError(f"replica {self.replica_id}: a worker thread is dead")


def _replica_id() -> str:
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return str(getattr(ctx.replica_id, "unique_id", None) or ctx.replica_tag)
    except Exception:  # outside a replica (tests, local use)
        return f"pid{os.getpid()}"


def tag(app, replica: str) -> None:
    """The replica's id on every response (a header) and on every metric sample (a label)."""
    app.add_middleware(ReplicaHeader, replica=replica)
    metrics = app.state.metrics
    metrics.registry = relabelled(metrics.registry, replica=replica)


class ReplicaHeader:
    """ASGI middleware: `x-specdecode-replica: <id>` on every response."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def relabelled(registry, **labels):
    """A registry whose samples are those of `registry` with `labels` added (read at every scrape)."""
    from prometheus_client import CollectorRegistry

    class Relabel:
        def collect(self):
            for family in registry.collect():
                family.samples = [s._replace(labels={**s.labels, **labels}) for s in family.samples]
                yield family

    out = CollectorRegistry(auto_describe=False)
    out.register(Relabel())
    return out


# -- the proxy: a replica that died mid-request ------------------------------------------------------------------------
def proxy_middlewares() -> list:
    """Ray Serve's HTTP proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): its Starlette middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFault)]


class ReplicaFault:
    """ASGI middleware in the proxy: a response the replica left unfinished (it died, or Ray gave up on it) ends
    as a 503 with Retry-After when nothing was sent yet, or with an error event and [DONE] in a started stream."""

    RETRY_AFTER_S = 1

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "done": False, "sse": False}

        async def watched(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers", ())).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            if not state["done"]:
                try:
                    await self._finish(state, scope, receive, send)
                except Exception:  # the client is gone: nothing to tell it
                    pass

    async def _finish(self, state, scope, receive, send):
        from .protocol import SSE_DONE, error_body, sse

        err = ReplicaLost(
            "the replica serving this request stopped before it finished; retry the request",
            retry_after=self.RETRY_AFTER_S,
        )
        if not state["started"]:
            from .service import error_response

            await error_response(err)(scope, receive, send)
        elif state["sse"]:
            body = (sse(error_body(err)) + SSE_DONE).encode()
            await send({"type": "http.response.body", "body": body, "more_body": False})


# -- the application ---------------------------------------------------------------------------------------------------
def ray_app(
    target: str | None = None,
    draft: str | None = None,
    *,
    method: str = DEFAULT_METHOD,
    gamma: int = DEFAULT_GAMMA,
    replicas: int = 1,
    autoscale: tuple[int, int] | None = None,
    threads: int = 1,
    target_ongoing_requests: float = 2.0,
    served_model_name: str | None = None,
    api_key: str | None = None,
    protect_all: bool = False,
    max_queue: int = 16,
    timeout_s: float = 300.0,
    show_sources: bool = False,
    max_tokens_cap: int | None = None,
    ctx_size: int | None = None,
    **load,
):
    """A Ray Serve application: `replicas` replicas (or autoscaled within `autoscale` = (min, max) on the requests
    queued and running per replica, `target_ongoing_requests` each), each an Engine on `threads` CPU threads
    serving the OpenAI-compatible app. max_tokens_cap, ctx_size, protect_all and show_sources: as
    `serve --max-tokens`, `--ctx-size`, `--protect-all` and `--speculation-sources`.
    `load`: more Engine.load arguments (backend, dtype, exact, datastore,
    history_tokens, draft_quant, draft_window, ...). Run it with `start(...)` then `serve.run(app)` (or inside
    your own Serve application)."""
    _check_ray()
    from fastapi import FastAPI
    from ray import serve

    from ..backends import DEFAULT_TARGET
    from ..methods import wants_draft_model
    from .app import model_name

    positive_int("threads", threads)
    scaling = _scaling(replicas, autoscale, target_ongoing_requests)
    load.setdefault("with_draft", wants_draft_model([method]) or draft is not None)
    load = dict(load, target=target, draft=draft, threads=threads)
    app = dict(
        model_id=served_model_name or model_name(target or DEFAULT_TARGET),
        method=method,
        gamma=gamma,
        api_key=api_key,
        protect_all=protect_all,
        max_queue=max_queue,
        timeout_s=timeout_s,
        max_tokens_cap=max_tokens_cap,
        show_sources=show_sources,
    )
    deployment = serve.deployment(
        name="SpecDecode",
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=max_queue + 1,
        health_check_period_s=5,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=10,
        **scaling,
    )(serve.ingress(FastAPI())(Replica))  # the placeholder app is replaced per replica (__serve_build_asgi_app__)
    return deployment.bind(load, app, ctx_size)


def _scaling(replicas: int, autoscale, target_ongoing_requests: float) -> dict:
    if autoscale is None:
        positive_int("replicas", replicas)
        return {"num_replicas": replicas}
    lo, hi = autoscale
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo < 0 or hi < max(1, lo):
        raise SpecDecodeError(f"autoscale must be MIN,MAX with 0 <= MIN <= MAX and MAX >= 1, got {lo},{hi}")
    if not target_ongoing_requests > 0:
        raise SpecDecodeError(f"target_ongoing_requests must be positive, got {target_ongoing_requests!r}")
    return {
        "autoscaling_config": {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": max(lo, 1),
            "target_ongoing_requests": target_ongoing_requests,
            "upscale_delay_s": 5,
            "downscale_delay_s": 60,
        }
    }


def start(host: str = "127.0.0.1", port: int = 8000, *, address: str | None = None, **init):
    """Connect to the Ray cluster at `address` ($RAY_ADDRESS, else the one `ray start` runs on this machine, else
    a new one in this process) and start Serve's HTTP proxies on host:port with `proxy_middlewares` installed."""
    ray = _check_ray()
    from ray import serve

    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": PROXY_CALLBACK, **SLOW_MACHINE_ENV}
    ours = not ray.is_initialized()  # a cluster connection this call makes, closed again if Serve cannot start
    error = None
    for _ in range(START_TRIES):
        try:
            if not ray.is_initialized():
                ray.init(address=address, **init)
            serve.start(
                http_options={"host": host, "port": port}, controller_options={"runtime_env": {"env_vars": env}}
            )
            return
        except Exception as e:  # Ray's own errors (ActorDiedError, RaySystemError, ...) share no base class
            error = e
            if ours and _started_here(ray):  # a half-started Serve before the next try; a shared one is not ours
                try:
                    serve.shutdown()
                except Exception:
                    pass
    if ours:
        try:
            ray.shutdown()
        except Exception:
            pass
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    raise SpecDecodeError(
        f"Ray Serve did not start its HTTP proxy on {host}:{port} ({START_TRIES} tries; a busy "
        f"machine, or the port taken?): {type(error).__name__}: {first}"
    )


def _started_here(ray) -> bool:
    """Whether this process started the Ray cluster it is connected to (not attached to one: $RAY_ADDRESS, a local
    `ray start`), so that shutting Serve down there stops no one else's applications. Ray tells it only through its
    node object; False where that cannot be read."""
    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    return getattr(node, "head", False) is True


def parse_autoscale(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SpecDecodeError(f"--autoscale takes MIN,MAX (two integers), got {text!r}") from None
    return lo, hi


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_ray(app, host: str, port: int, scale: str, settings: str) -> None:
    """Run `app` (ray_app's) on Ray Serve at host:port until interrupted; `scale` and `settings` describe it in the
    lines printed."""
    import ray
    from ray import serve

    start(host, port)
    for sig in (signal.SIGINT, signal.SIGTERM):  # both stop it in order (Ray's own SIGTERM handler leaves agents
        signal.signal(sig, _interrupt)  # behind; a shell's background job starts with SIGINT ignored)
    try:
        sys.stderr.write(f"specdecode: starting {scale} on Ray Serve; loading the models\n")
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed: its traceback is in the log above
            raise SpecDecodeError(f"the replicas did not start (see the replica's error above): {e}") from None
        except Exception as e:  # Ray itself (its controller or proxy died): one line, not Ray's traceback
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise SpecDecodeError(f"Ray Serve could not deploy the replicas: {type(e).__name__}: {first}") from None
        sys.stderr.write(
            f"specdecode: serving at http://{host}:{port}/v1 on every node of the Ray cluster "
            f"({settings}); Ctrl-C stops it\n"
        )
        while True:
            time.sleep(3600)
    finally:
        try:
            serve.delete(APP_NAME)
        except Exception:  # a Serve that never came up, or died: nothing to delete, and no traceback over the error
            pass
        finally:
            ray.shutdown()
