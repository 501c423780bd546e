"""W3C trace context through the gateway, and the gateway's own spans.

With an OTLP endpoint in the environment (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
OTEL_EXPORTER_OTLP_ENDPOINT, as every OpenTelemetry SDK reads them; `pergola serve
--otlp-endpoint` sets the first for its gateway), the gateway exports a server span per HTTP
request, a child of the caller's `traceparent` when it sends one, and a client span per Triton
call under it, whose context goes to Triton as `traceparent` so that Triton's spans hang below
it in the same trace. Without one it makes no spans and passes a well-formed `traceparent` on
unchanged, as a proxy does; a malformed header is dropped rather than passed on.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from pergola.config.settings import external
from pergola.gateway.metrics import StatusSend

TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_current: ContextVar[str | None] = ContextVar("traceparent", default=None)


def exporting() -> bool:
    return bool(external("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or external("OTEL_EXPORTER_OTLP_ENDPOINT"))


def require_sdk() -> None:
    """Refuse to start a gateway told to export spans without the packages that export them:
    otherwise every request would fail with a 500 on its first span (seen where the gateway's
    host lacked them)."""
    if not exporting():
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"an OTLP endpoint is set (--otlp-endpoint or OTEL_EXPORTER_OTLP_*ENDPOINT) but {e}: "
                           "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http, or unset it") from None


@functools.lru_cache(maxsize=1)
def tracer() -> Any:
    """The gateway's tracer (batched OTLP/HTTP export), or None when no endpoint is configured."""
    if not exporting():
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": external("OTEL_SERVICE_NAME", "pergola-gateway")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider.get_tracer("pergola.gateway")


def _traceparent(scope: dict[str, Any]) -> str | None:
    raw = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1").strip().lower()
    return raw if TRACEPARENT.fullmatch(raw) else None


class TraceContext:
    """ASGI middleware: the request's span (with a tracer) or its traceparent (without one)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif tracer() is None:
            token = _current.set(_traceparent(scope))
            try:
                await self.app(scope, receive, send)
            finally:
                _current.reset(token)
        else:
            await self._traced(scope, receive, send)

    async def _traced(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = _traceparent(scope)
        context = TraceContextTextMapPropagator().extract({"traceparent": parent} if parent else {})
        answer = StatusSend(send)
        with tracer().start_as_current_span(f"{scope['method']} {scope['path']}", context=context,
                                            kind=SpanKind.SERVER) as span:
            span.set_attributes({"http.request.method": scope["method"], "url.path": scope["path"]})
            try:
                await self.app(scope, receive, answer)
            finally:
                span.set_attribute("http.response.status_code", answer.status)
                if answer.status >= 500:
                    span.set_status(Status(StatusCode.ERROR))


def with_trace(headers: dict[str, str] | None) -> dict[str, str] | None:
    """`headers` for a Triton call plus the request's traceparent (an HTTP header or gRPC
    metadata), without a tracer."""
    value = _current.get()
    if value is None:
        return headers
    return {**(headers or {}), "traceparent": value}


@contextlib.contextmanager
def triton_call(model: str, headers: dict[str, str] | None, transport: str = "grpc") -> Iterator[dict[str, str] | None]:
    """The headers of one Triton call (`transport`: http or grpc), inside a client span of its own
    when the gateway traces."""
    if tracer() is None:
        yield with_trace(headers)
        return
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    attributes = ({"rpc.system": "grpc", "rpc.service": "inference.GRPCInferenceService", "rpc.method": "ModelInfer"}
                  if transport == "grpc" else {"http.request.method": "POST", "url.path": f"/v2/models/{model}/infer"})
    with tracer().start_as_current_span(f"triton {model}", kind=SpanKind.CLIENT,
                                        attributes=attributes | {"triton.model": model}):
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)  # this span's context, for Triton's spans
        yield {**(headers or {}), **carrier}
