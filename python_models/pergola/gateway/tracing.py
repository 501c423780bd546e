"""W3C trace context through the gateway: a request's `traceparent` header goes on with every
Triton call made for it, so that Triton's OpenTelemetry spans (`pergola serve --otlp-endpoint`)
join the caller's trace. The gateway forwards the context unchanged, as a proxy without spans of
its own does; a malformed header is dropped rather than passed on.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from typing import Any, Callable

TRACEPARENT = re.compile(r"[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_current: ContextVar[str | None] = ContextVar("traceparent", default=None)


class TraceContext:
    """ASGI middleware: the request's traceparent, if valid, for the Triton calls it makes."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        value = None
        if scope["type"] == "http":
            raw = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1").strip().lower()
            value = raw if TRACEPARENT.fullmatch(raw) else None
        token = _current.set(value)
        try:
            await self.app(scope, receive, send)
        finally:
            _current.reset(token)


def with_trace(headers: dict[str, str] | None) -> dict[str, str] | None:
    """`headers` for a Triton call, plus the current request's traceparent (gRPC metadata)."""
    value = _current.get()
    if value is None:
        return headers
    return {**(headers or {}), "traceparent": value}
