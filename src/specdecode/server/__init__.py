"""OpenAI-compatible HTTP server: `specdecode serve` (needs the `server` extra: pip install "specdecode[server]").

    specdecode serve --method draft --gamma 4            # http://127.0.0.1:8000/v1

Four parts: `protocol` (request and response models: the wire format, and how bad input becomes an
OpenAI-style error), `scheduler` (the one worker thread, its bounded FIFO queue, cancellation and
deadlines; no HTTP), `service` (what the routes do: a request opened as an Engine stream, queued, and its
events turned into a response) and `app` (the FastAPI app, its routes and middleware, and `run`); the command,
its arguments and the models it loads are in cli/serve.py.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream false or true;
streams are server-sent events in OpenAI's chunk format ending with `data: [DONE]`), GET /health,
GET /metrics (Prometheus text).

On Ray Serve (the `ray` extra): `specdecode serve --ray --replicas N`, or `ray_app(...)`, a Serve application of
replicas that each load their own Engine (`ray_serve`).
"""

from __future__ import annotations

from ..lazy import lazy_names

# at shutdown, the longest uvicorn waits for open connections once the worker has stopped every generation (a
# client that reads its stream slowly, or not at all, would otherwise hold the shutdown without end); here, not in
# app.py, so that the soak test's judgement reads it without the server's packages
GRACEFUL_SHUTDOWN_S = 10

# each name and its module, imported on first use: the CLI builds serve's parser (cli/serve.py) without the extra
_EXPORTS = {
    "create_app": ".app",
    "run": ".app",
    "ray_app": ".ray_serve",
    "run_ray": ".ray_serve",
    "engine_lock": ".scheduler",
}

__all__ = ["create_app", "run", "engine_lock", "ray_app", "run_ray"]


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
