"""The gateway's own Prometheus metrics (prometheus_client), at its `GET /metrics`.

    pergola_gateway_request_duration_seconds{route}   histogram: from the request's arrival to
                                                      the last byte of its answer
    pergola_gateway_requests_total{route,status}      answers by HTTP status
    pergola_gateway_requests_in_flight                requests being answered now
    pergola_gateway_inputs_total{task,tokenized}      texts embedded / query + documents reranked, by
                                                      where they were tokenized: gateway or triton

`route` is the route's path (/v1/embeddings, /embed, ...); any other path counts as "other",
so a scan of random URLs cannot grow the series without bound. The process's own metrics
(CPU, memory, open files) come with them. With --gateway-workers above 1 each worker is a
process of its own, counting into PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess
mode; a fresh folder when it is not set, app.shared_metrics), and every worker's counts are
summed at each scrape.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pergola.config.settings import external

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]
PATH = "/metrics"
# 1 ms (a short query answered from a warm server) to 60 s (a bulk request of thousands of texts)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

DURATION = Histogram("pergola_gateway_request_duration_seconds", "seconds from a request's arrival to the end "
                     "of its answer", ["route"], buckets=BUCKETS)
REQUESTS = Counter("pergola_gateway_requests", "requests answered, by route and HTTP status", ["route", "status"])
INPUTS = Counter("pergola_gateway_inputs", "texts embedded (embed) or classified (classify), query and documents "
                 "reranked (rerank), by "
                 "where they were tokenized: in the gateway (short requests, gateway/tokenizers.py) or by "
                 "Triton's tokenizer instances", ["task", "tokenized"])
IN_FLIGHT = Gauge("pergola_gateway_requests_in_flight", "requests being answered now",
                  multiprocess_mode="livesum")


def inputs_by_tokenizer(exposition: str) -> dict[str, float]:
    """pergola_gateway_inputs_total summed over tasks, by where the inputs were tokenized
    ({"gateway": n, "triton": m}), from a /metrics page's text (benchmarks and tests read it)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name == "pergola_gateway_inputs":
            for sample in family.samples:
                if sample.name == "pergola_gateway_inputs_total":
                    where = sample.labels["tokenized"]
                    found[where] = found.get(where, 0.0) + sample.value
    return found


class StatusSend:
    """An ASGI `send` that remembers the answer's status: 500 until one starts (what the client
    sees when the app fails before answering)."""

    def __init__(self, send: Callable) -> None:
        self.send, self.status = send, 500

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self.send(message)


class RequestMetrics:
    """ASGI middleware that times every HTTP request and counts its status."""

    def __init__(self, app: ASGIApp, paths: Iterable[str]) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.paths else "other"
        answer = StatusSend(send)
        started = time.perf_counter()
        IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, answer)
        finally:
            IN_FLIGHT.dec()
            DURATION.labels(route).observe(time.perf_counter() - started)
            REQUESTS.labels(route, str(answer.status)).inc()


def registry() -> CollectorRegistry:
    """This process's metrics, or every worker's in prometheus_client's multiprocess mode."""
    if not external("PROMETHEUS_MULTIPROC_DIR"):
        return DEFAULT_REGISTRY
    from prometheus_client import multiprocess

    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged)
    return merged


async def metrics(request: Request) -> Response:
    """Prometheus' text format (no API key: scrapers rarely carry one, and nothing here is a
    request's content)."""
    return Response(generate_latest(registry()), media_type=CONTENT_TYPE_LATEST)


def route() -> Route:
    return Route(PATH, metrics, methods=["GET"])
