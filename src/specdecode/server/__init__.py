"""OpenAI-compatible HTTP server: `specdecode serve` (needs the `server` extra: pip install "specdecode[server]").

    specdecode serve --method draft --gamma 4            # http://127.0.0.1:8000/v1

Four parts: `protocol` (request and response models: the wire format, and how bad input becomes an
OpenAI-style error), `scheduler` (the one worker thread, its bounded FIFO queue, cancellation and
deadlines; no HTTP), `service` (what the routes do: a request opened as an Engine stream, queued, and its
events turned into a response) and `app` (the FastAPI app, its routes and middleware, and `serve`).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream false or true;
streams are server-sent events in OpenAI's chunk format ending with `data: [DONE]`), GET /health,
GET /metrics (Prometheus text).

On Ray Serve (the `ray` extra): `specdecode serve --ray --replicas N`, or `ray_app(...)`, a Serve application of
replicas that each load their own Engine (`ray_serve`).
"""
from .app import create_app, serve
from .ray_serve import ray_app, serve_ray
from .scheduler import engine_lock

__all__ = ["create_app", "serve", "engine_lock", "ray_app", "serve_ray"]
