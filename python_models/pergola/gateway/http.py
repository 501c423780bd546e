"""The HTTP side shared by every route: reading a JSON body within its limit (a large one parsed
in a CPU worker, gateway/offload.py), typed fields whose errors name the field, the API key, and
answering in the route family's envelope (a large answer rendered in a CPU worker).

Integer fields are checked as numbers before anything uses them: an integer (not a boolean, not a
decimal) in the field's range, else 400 naming it. orjson reads integers up to 2^64 - 1 as int
and larger ones as float; an INT32 tensor would wrap 2^32 + 128 to 128, and numpy refuses 2^63
with an OverflowError (a 500), so the range is checked here.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pergola.gateway.errors import GatewayError, bad_request, refused
from pergola.gateway.offload import INT32_MAX, PARSE_BYTES, RENDER_VALUES, Offload, TokenIds, parse_body, render
from pergola.text.errors import MESSAGE_CHARS, RequestError, bounded, quote

log = logging.getLogger("pergola.gateway")
CLIENT_GONE = 499  # nginx's status for a request whose client left first: counted, never sent
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", float: "a number",
               list: "a list", dict: "an object", TokenIds: "token ids"}


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

    def count(self, name: str, most: int = INT32_MAX) -> int | None:
        """A positive integer field, at most `most` (what an INT32 tensor holds): 400 naming it
        for anything else, booleans and decimals included."""
        value = self.data.get(name)
        if value is None:
            return None
        if type(value) is not int or not 1 <= value <= most:
            shown = "true or false" if isinstance(value, bool) else quote(value)
            raise bad_request(f"`{name}` must be an integer from 1 to {most:,}, got {shown}", name)
        return value


async def read_body(request: Request, max_bytes: int, offload: Offload | None = None,
                    ids_field: str | None = None) -> Body:
    """The JSON body (413 over `max_bytes`), its `ids_field` as TokenIds when it holds token ids;
    a body of PARSE_BYTES or more is parsed in a CPU worker (gateway/offload.py)."""
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
    if offload is not None and len(raw) >= PARSE_BYTES:
        return Body(await offload.run(parse_body, raw, ids_field))
    return Body(parse_body(raw, ids_field))


async def answer(offload: Offload, values: int, build: Callable[..., Any], *args: Any,
                 headers: dict[str, str] | None = None) -> Response:
    """build(*args) as the JSON answer: rendered on the loop when it holds fewer than
    RENDER_VALUES numbers (`values`), else in a CPU worker (gateway/offload.py)."""
    content = render(build, *args) if values < RENDER_VALUES else await offload.run(render, build, *args)
    return Response(content, media_type=JSONResponse.media_type, headers=headers)


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
    before any work) are 413 when a limit was passed, else 400; a field of the wrong type or
    value is 422 in TEI's envelope (as TEI answers) and 400 in the others. The message is cut to
    pergola.text.errors.MESSAGE_CHARS: the last guard against echoing what a client sent."""
    if isinstance(exc, RequestError):
        exc = refused(str(exc))
    if exc.status == 422 and family != "tei":  # TEI answers a bad field 422; OpenAI, vLLM, Cohere 400
        exc = GatewayError(400, exc.message, exc.param)
    if len(exc.message) > MESSAGE_CHARS:
        exc = GatewayError(exc.status, bounded(exc.message), exc.param)
    return JSONResponse(exc.body(family), status_code=exc.status, headers=exc.headers())


def endpoint(family: str, handler: Handler, keys: Keys | None) -> Callable[[Request], Awaitable[Response]]:
    """A route: key check, the handler's result as JSON, errors in `family`'s envelope."""

    async def pick(request: Request) -> tuple[str, Handler]:
        if keys is not None:
            keys.check(request)
        return family, handler

    return dispatch(family, pick)


Pick = Callable[[Request], Awaitable[tuple[str, Handler]]]


def dispatch(family: str, pick: Pick) -> Callable[[Request], Awaitable[Response]]:
    """A route whose handler and envelope pick(request) chooses (it checks the key: a route that
    speaks several APIs reads the body first, to answer in the envelope the body speaks); an
    error before the choice is in `family`'s envelope."""

    async def run(request: Request) -> Response:
        chosen = family
        try:
            chosen, handler = await pick(request)
            result = await handler(request)
            return result if isinstance(result, Response) else JSONResponse(result)
        except (GatewayError, RequestError) as e:
            return error_response(e, chosen)
        except Exception as e:  # noqa: BLE001 - a bug here: say so in the API's envelope, keep serving
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(GatewayError(500, f"internal error in the gateway: {type(e).__name__}: {e}"),
                                  chosen)

    return run
