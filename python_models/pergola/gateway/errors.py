"""Errors the gateway answers with, and how Triton's errors map onto HTTP status codes.

Each API family wraps the same error in its own envelope (clients parse it):
    openai  {"error": {"message", "type", "param", "code"}}
    cohere  {"message"}                                  (Jina reads the same)
    tei     {"error", "error_type"}
"""

from __future__ import annotations

import re
from typing import Any

# status -> (OpenAI error type, TEI error_type)
_TYPES = {
    400: ("invalid_request_error", "Validation"),
    401: ("authentication_error", "Unauthorized"),
    404: ("not_found_error", "Validation"),
    408: ("timeout_error", "Validation"),
    413: ("invalid_request_error", "Validation"),
    422: ("invalid_request_error", "Validation"),
    429: ("rate_limit_error", "Overloaded"),
    503: ("service_unavailable", "Unhealthy"),
    504: ("timeout_error", "Backend"),
}
RETRY_AFTER_S = 1  # what a 429 / 503 tells the client to wait, unless it says (admission.py: the backlog)


class GatewayError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s: int | None = None  # whole seconds

    def headers(self) -> dict[str, str]:
        if self.status not in (429, 503):
            return {}
        return {"Retry-After": str(self.retry_after_s or RETRY_AFTER_S)}

    def body(self, family: str) -> dict[str, Any]:
        openai_type, tei_type = _TYPES.get(self.status, ("server_error", "Backend"))
        if family == "openai":
            return {"error": {"message": self.message, "type": openai_type, "param": self.param,
                              "code": self.status}}
        if family == "tei":
            return {"error": self.message, "error_type": tei_type}
        return {"message": self.message}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param)


# Triton's refusals that another replica (or a later retry) may accept.
_OVERLOAD_MARKS = ("queued tokens", "Exceeds maximum queue size", "max_queue_seconds")
# A model instance whose Python stub process died (Triton 2.51 answers INTERNAL, HTTP 500, for each
# request that reaches it): `pergola serve` loads that model again within seconds
# (pergola/triton/supervisor.py), so it is a model away, 503 + Retry-After, not a server error.
_STUB_DEAD = re.compile(r"Stub process (?:'[^']*' )?is (?:not healthy|unhealthy)|Failed to restart the stub process")
# The encoder's answer to a request past its deadline (engine/loop.py's Cancelled): CANCELLED over
# gRPC, but Triton's HTTP door answers CANCELLED as 400 like a bad input, so the message decides.
_DEADLINE_MARKS = ("timeout passed before it was computed", "cannot finish before its timeout")


def refused(message: str) -> GatewayError:
    """A request refused by pergola's input checks (the engine's RequestError, here or in
    Triton): 413 when it passed a limit, else 400."""
    return GatewayError(413 if "the limit is" in message else 400, message)


def from_triton(status: str, message: str) -> GatewayError:
    """A Triton error (gRPC status name, message) as the gateway's error."""
    code = status.rsplit(".", 1)[-1]
    # (an unloaded model, or a version of it no longer served, comes as INVALID_ARGUMENT or as
    # UNAVAILABLE "... version N is not at ready state": not a replica that is down)
    if "Request for unknown model" in message or code == "INVALID_ARGUMENT" and "is not found" in message:
        return GatewayError(404, message)
    if _STUB_DEAD.search(message):
        return GatewayError(503, f"{message} (a process of this model stopped; it is being loaded again: retry "
                                 "shortly)")
    if code in ("DEADLINE_EXCEEDED", "CANCELLED") or any(mark in message for mark in _DEADLINE_MARKS):
        return GatewayError(504, message)
    if code == "INVALID_ARGUMENT":
        return refused(message)
    if code == "NOT_FOUND":
        return GatewayError(404, message)
    if code == "UNAVAILABLE" and any(mark in message for mark in _OVERLOAD_MARKS):
        return GatewayError(429, message)
    if code == "UNAVAILABLE":
        return GatewayError(503, message)
    return GatewayError(500, message)
