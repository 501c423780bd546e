"""The HTTP side shared by every route: reading a JSON body within its limit, typed fields
whose errors name the field, the API key, and answering in the route family's envelope."""

from __future__ import annotations

import hmac
import logging
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pergola.errors import RequestError
from pergola.gateway.errors import GatewayError, bad_request, refused

log = logging.getLogger("pergola.gateway")
CLIENT_GONE = 499  # nginx's status for a request whose client left first: counted, never sent
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", float: "a number",
               list: "a list", dict: "an object"}


class JSONResponse(Response):
    """orjson, numpy arrays written directly (an embedding row is never a Python list)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class Body:
    """A request's JSON object; `get` checks each field's type and names it when it is wrong."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict):
            raise bad_request("the request body must be a JSON object")
        self.data = data

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None, required: bool = False) -> Any:
        value = self.data.get(name)
        if value is None:
            if required:
                raise GatewayError(422, f"`{name}` is required", name)
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise GatewayError(422, f"`{name}` must be {wanted}, got {type(value).__name__}", name)
        return value

    def positive(self, name: str) -> int | None:
        value = self.get(name, int)
        if value is not None and value < 1:
            raise GatewayError(422, f"`{name}` must be at least 1, got {value}", name)
        return value


async def read_body(request: Request, max_bytes: int) -> Body:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise GatewayError(413, f"the request body is {int(declared):,} bytes; the limit is {max_bytes:,} "
                                "(--max-body-bytes): split the request")
    raw = bytearray()
    try:
        async for part in request.stream():
            raw += part
            if len(raw) > max_bytes:
                raise GatewayError(413, f"the request body is over the limit of {max_bytes:,} bytes "
                                        "(--max-body-bytes): split the request")
    except ClientDisconnect:  # an aborted upload (or --body-timeout-s): nobody is left to answer
        log.info("%s %s: the client left after %d bytes of its body", request.method, request.url.path, len(raw))
        raise GatewayError(CLIENT_GONE, "the client left before sending the whole body") from None
    try:
        return Body(orjson.loads(raw))
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


class Keys:
    """API keys: `Authorization: Bearer KEY` on every route that asks (all but /health)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = [k.encode() for k in keys]

    def check(self, request: Request) -> None:
        if not self.keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        token = given.strip().encode()
        # compare_digest against every key: the time taken says nothing about a key
        if scheme.lower() != "bearer" or not any([hmac.compare_digest(token, k) for k in self.keys]):
            raise GatewayError(401, "missing or wrong API key: send `Authorization: Bearer <key>`")


Handler = Callable[[Request], Awaitable[Any]]


def error_response(exc: GatewayError | RequestError, family: str) -> Response:
    """An error in `family`'s envelope; the engine's own input checks (RequestError, run here
    before any work) are 413 when a limit was passed, else 400."""
    if isinstance(exc, RequestError):
        exc = refused(str(exc))
    return JSONResponse(exc.body(family), status_code=exc.status, headers=exc.headers())


def endpoint(family: str, handler: Handler, keys: Keys | None) -> Callable[[Request], Awaitable[Response]]:
    """A route: key check, the handler's result as JSON, errors in `family`'s envelope."""

    async def run(request: Request) -> Response:
        try:
            if keys is not None:
                keys.check(request)
            result = await handler(request)
            return result if isinstance(result, Response) else JSONResponse(result)
        except (GatewayError, RequestError) as e:
            return error_response(e, family)
        except Exception as e:  # noqa: BLE001 - a bug here: say so in the API's envelope, keep serving
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(GatewayError(500, f"internal error in the gateway: {type(e).__name__}: {e}"),
                                  family)

    return run
