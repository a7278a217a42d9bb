"""The server's Prometheus metrics (GET /metrics), in their own CollectorRegistry."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """Prometheus metrics in their own CollectorRegistry (several apps can live in one process)."""

    def __init__(self, model_id: str, method: str, gamma: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "specdecode_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.generations = Counter(
            "specdecode_generations",
            "generations by finish reason (stop, length, timeout, cancelled, error)",
            ["finish_reason"],
            registry=r,
        )
        self.errors = Counter(
            "specdecode_generation_errors",
            "generations that failed once queued, by the HTTP status and error code their client got",
            ["status", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("specdecode_generated_tokens", "tokens generated", registry=r)
        self.drafted_tokens = Counter("specdecode_drafted_tokens", "draft tokens proposed", ["method"], registry=r)
        self.accepted_tokens = Counter("specdecode_accepted_tokens", "draft tokens accepted", ["method"], registry=r)
        self.drafted_by_position = Counter(
            "specdecode_drafted_by_position",
            "draft tokens proposed at draft position i (0 = first)",
            ["position"],
            registry=r,
        )
        self.accepted_by_position = Counter(
            "specdecode_accepted_by_position",
            "draft tokens accepted at draft position i; acceptance at i = accepted / drafted",
            ["position"],
            registry=r,
        )
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
        self.ttft = Histogram(
            "specdecode_time_to_first_token_seconds",
            "from request arrival to the first text",
            buckets=latency_buckets,
            registry=r,
        )
        self.latency = Histogram(
            "specdecode_request_latency_seconds",
            "from request arrival to the end of its generation",
            ["endpoint"],
            buckets=latency_buckets,
            registry=r,
        )
        self.queue_wait = Histogram(
            "specdecode_queue_wait_seconds", "time a request waited for the worker", buckets=latency_buckets, registry=r
        )
        self.queued = Gauge("specdecode_queue_depth", "requests waiting for the worker", registry=r)
        self.busy = Gauge("specdecode_worker_busy", "1 while the worker is generating", registry=r)
        info = Gauge(
            "specdecode_server_info", "served model and default speculation", ["model", "method", "gamma"], registry=r
        )
        info.labels(model=model_id, method=method, gamma=str(gamma)).set(1)

    def record(self, stats, endpoint: str, arrival: float, finish: str, ttft_seen: bool) -> None:
        now = time.monotonic()
        if not ttft_seen:
            self.ttft.observe(now - arrival)
        self.latency.labels(endpoint=endpoint).observe(now - arrival)
        self.generations.labels(finish_reason=finish).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.drafted_tokens.labels(method=stats.method).inc(stats.drafted)
        self.accepted_tokens.labels(method=stats.method).inc(stats.accepted)
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            self.drafted_by_position.labels(position=str(i)).inc(d)
            self.accepted_by_position.labels(position=str(i)).inc(a)
