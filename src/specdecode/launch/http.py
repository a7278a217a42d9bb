"""The HTTP requests that bench and the load test send outside a load run's client (a server's health and metrics
while it starts or idles, a peer's streamed answer): all on one TLS context, httpx's default one, made once. httpx
builds a context for every client, and a module-level `httpx.get` is a client: ~35 ms of CPU loading the CA file,
beside a server that is starting on the same cores (a start-up polls the health every half second)."""

from __future__ import annotations

from functools import cache


@cache
def tls():
    import httpx

    return httpx.create_ssl_context()


def get(url: str, **kwargs):
    import httpx

    return httpx.get(url, verify=tls(), **kwargs)


def stream(method: str, url: str, **kwargs):
    import httpx

    return httpx.stream(method, url, verify=tls(), **kwargs)
