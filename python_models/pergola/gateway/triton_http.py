"""Inference over Triton's HTTP port (KServe v2 with the binary-tensor extension), the gateway's
hot path to a replica.

Why not tritonclient's gRPC aio client, which the gateway keeps for its control calls: a small
call costs the gateway about three times the CPU through it (protobuf objects, grpc's poller
thread and its hand-offs to the event loop) as through this client, whose request is one JSON
header plus the tensors' bytes written on the loop's thread and whose answer is parsed by
httptools (uvicorn's own C parser); the round trip is shorter than over gRPC, Triton's HTTP door
included (perf/results/2026-12-05-88093b5-cpu/NOTES.md).

HTTP/1.1 carries one call per connection at a time, so each replica keeps a pool of keep-alive
connections, opened as concurrency needs them up to MAX_CONNECTIONS (beyond that a call waits
for one, within its deadline: file descriptors are finite). A connection idle for IDLE_S, or
open for MAX_AGE_S, is closed after its call: tritonserver's shutdown waits (up to its exit
timeout, 30 s) until every HTTP connection to it has closed, serving the calls they carry
meanwhile, and exits 1 if one is still open then. With connections that end, a server told to
stop under steady traffic exits 0 within seconds and the gateway sees its door closed (measured
in tests/test_gateway.py). A call that fails on a reused
connection before any byte of its answer came back (the server closed it while idle) is sent
once more on a new one: inference calls have no side effects.

Errors come back as tritonclient's InferenceServerException with the gRPC status name of the
same Triton error code, so that gateway/errors.py maps both transports the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import httptools
import numpy as np
import orjson
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor

# Triton's HTTP status -> the gRPC status name errors.from_triton reads. Triton answers 404
# (NOT_FOUND), 501 (UNSUPPORTED), 503 (UNAVAILABLE), 500 (INTERNAL) and 400 for the rest: invalid
# argument, unknown, already exists and cancelled alike (server/src/http_server.cc,
# HttpCodeFromError); 504 comes from a proxy in between. Anything else reads as INTERNAL.
_STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE",
           504: "DEADLINE_EXCEEDED"}
# numpy dtype of each Triton datatype that crosses this door as raw bytes (BYTES: length-prefixed)
_DTYPES = {"BOOL": np.bool_, "INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16,
           "INT32": np.int32, "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
MAX_IDLE = 64  # keep-alive connections kept per replica; more are opened when more calls are in flight
MAX_CONNECTIONS = 256  # ...up to this many at once per replica
IDLE_S = 2.0  # a keep-alive connection unused this long is closed
MAX_AGE_S = 5.0  # ...and one open this long, after its call


@dataclass(frozen=True)
class Tensor:
    """One input of a call: its name, its values and their Triton datatype."""

    name: str
    array: np.ndarray
    datatype: str

    def raw(self) -> bytes:
        if self.datatype == "BYTES":
            return serialize_byte_tensor(self.array).item() if self.array.size else b""
        return np.ascontiguousarray(self.array, dtype=_DTYPES[self.datatype]).tobytes()


class Answer:
    """A call's outputs, read the way tritonclient's InferResult is (`as_numpy(name)`)."""

    def __init__(self, header: dict[str, Any], body: memoryview) -> None:
        self._outputs: dict[str, tuple[str, list[int], memoryview]] = {}
        offset = 0
        for out in header.get("outputs", []):
            size = out.get("parameters", {}).get("binary_data_size")
            if size is None:  # (only binary outputs are asked for; a server that ignored it says so here)
                raise InferenceServerException(f"Triton sent output {out['name']} as JSON, not binary",
                                               status="StatusCode.INTERNAL")
            self._outputs[out["name"]] = (out["datatype"], out["shape"], body[offset:offset + size])
            offset += size

    def as_numpy(self, name: str) -> np.ndarray | None:
        if name not in self._outputs:
            return None
        datatype, shape, data = self._outputs[name]
        if datatype == "BYTES":
            return deserialize_bytes_tensor(bytes(data)).reshape(shape)
        return np.frombuffer(data, dtype=_DTYPES[datatype]).reshape(shape)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one call at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future | None = None
        self.header_length: int | None = None
        self.chunks: list[bytes] = []
        self.started = False  # a byte of the current answer has come
        self.keep_alive = False  # the current answer lets the connection serve another call
        self.closed = False
        self.idle_timer: asyncio.TimerHandle | None = None  # closes it after IDLE_S unused
        self.opened_at = asyncio.get_running_loop().time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionResetError(f"Triton closed the connection: {exc or 'EOF'}"))

    def data_received(self, data: bytes) -> None:
        self.started = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.transport.close()
            if self.answer is not None and not self.answer.done():
                self.answer.set_exception(ConnectionResetError(f"unreadable answer from Triton: {e}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.header_length = int(value)

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # (read here: after the body it is reset)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.chunks)
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), self.header_length, body))

    async def send(self, head: bytes, parts: list[bytes]) -> tuple[int, int | None, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        self.header_length, self.chunks, self.started, self.keep_alive = None, [], False, False
        self.transport.writelines([head, *parts])
        try:
            return await self.answer
        finally:
            self.answer = None

    def reusable(self) -> bool:
        return not self.closed and self.keep_alive


class TritonHTTP:
    """Inference calls to one Triton server's HTTP port (HOST:PORT)."""

    def __init__(self, address: str, max_idle: int = MAX_IDLE, max_connections: int = MAX_CONNECTIONS,
                 idle_s: float = IDLE_S, max_age_s: float = MAX_AGE_S) -> None:
        self.address = address
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.max_idle, self.idle_s, self.max_age_s = max_idle, idle_s, max_age_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        try:
            _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        except OSError as e:
            raise InferenceServerException(f"failed to connect to Triton's HTTP port at {self.address}: {e} "
                                           "(--triton-http-port; 0 sends inference over gRPC)",
                                           status="StatusCode.UNAVAILABLE") from None
        return conn

    async def infer(self, model: str, inputs: list[Tensor], outputs: list[str], version: str = "",
                    timeout_s: float | None = None, headers: dict[str, str] | None = None,
                    parameters: dict[str, Any] | None = None) -> Answer:
        """Outputs `outputs` of `model` for `inputs`; Triton is told the deadline too (µs), and
        the request's `parameters`."""
        path = f"/v2/models/{model}/versions/{version}/infer" if version else f"/v2/models/{model}/infer"
        raws = [t.raw() for t in inputs]
        request: dict[str, Any] = {
            "inputs": [{"name": t.name, "shape": list(t.array.shape), "datatype": t.datatype,
                        "parameters": {"binary_data_size": len(raw)}} for t, raw in zip(inputs, raws)],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs]}
        if timeout_s is not None or parameters:
            request["parameters"] = (parameters or {}) | ({"timeout": int(timeout_s * 1e6)} if timeout_s else {})
        body = orjson.dumps(request)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.address}\r\nContent-Type: application/octet-stream\r\n"
                f"Inference-Header-Content-Length: {len(body)}\r\n"
                f"Content-Length: {len(body) + sum(map(len, raws))}\r\n{extra}\r\n").encode("latin-1")
        try:
            async with asyncio.timeout(timeout_s), self._slots:
                status, header_length, answer = await self._call(head, [body, *raws])
        except TimeoutError:
            raise InferenceServerException(f"no answer from Triton at {self.address} within {timeout_s:g} s",
                                           status="StatusCode.DEADLINE_EXCEEDED") from None
        if status != 200:
            raise _error(status, answer)
        n = header_length if header_length is not None else len(answer)
        return Answer(orjson.loads(answer[:n]), memoryview(answer)[n:])

    async def _call(self, head: bytes, parts: list[bytes]) -> tuple[int, int | None, bytes]:
        """One request on an idle connection (a new one if none); once more on a new connection if
        a reused one was found closed before its answer began."""
        while self._idle:
            conn = self._idle.pop()
            conn.idle_timer.cancel()
            if conn.closed:
                continue
            try:
                return await self._on(conn, head, parts)
            except ConnectionResetError:
                if conn.started:
                    raise _lost(self.address) from None
                break  # (closed while idle: retry below on a fresh connection)
        try:
            return await self._on(await self._connect(), head, parts)
        except ConnectionResetError:
            raise _lost(self.address) from None

    async def _on(self, conn: _Connection, head: bytes, parts: list[bytes]) -> tuple[int, int | None, bytes]:
        self._busy.add(conn)
        done = False
        try:
            answer = await conn.send(head, parts)
            done = True
            return answer
        finally:
            self._busy.discard(conn)
            loop = asyncio.get_running_loop()
            if (done and conn.reusable() and len(self._idle) < self.max_idle
                    and loop.time() - conn.opened_at < self.max_age_s):
                conn.idle_timer = loop.call_later(self.idle_s, self._expire, conn)
                self._idle.append(conn)
            else:  # (cancelled or failed mid-call: the connection's state is unknown)
                conn.transport.close()

    def _expire(self, conn: _Connection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)
            conn.transport.close()

    async def close(self) -> None:
        for conn in [*self._idle, *self._busy]:
            with contextlib.suppress(Exception):
                conn.transport.close()
        self._idle.clear()


def _lost(address: str) -> InferenceServerException:
    return InferenceServerException(f"lost the connection to Triton at {address}", status="StatusCode.UNAVAILABLE")


def _error(status: int, body: bytes) -> InferenceServerException:
    """Triton's HTTP error answer ({"error": message}) as the gRPC-named exception."""
    try:
        message = orjson.loads(body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body[:300].decode("utf-8", "replace")
    return InferenceServerException(message, status=f"StatusCode.{_STATUS.get(status, 'INTERNAL')}")
