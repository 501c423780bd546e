"""Connection discipline of the gateway's HTTP/1.1 door: what a slow, idle or absent client may cost.

Every connection is always under one clock (as nginx's client_header_timeout, client_body_timeout
and keepalive_timeout):
    waiting for headers   --header-timeout-s from the connection's opening, or from the first byte
                          of a keep-alive connection's next request; then closed
    receiving the body    --body-timeout-s for the whole body from the end of the headers; then
                          408 and closed
    with the app          the request's own deadline (--request-timeout-s), not this module's
    idle between requests --keep-alive-timeout-s (uvicorn's own timer); then closed
The body's clock is a deadline for the whole body, not for each read: a per-read timeout lets a
client that sends one byte just inside it hold its connection (and its buffered body) for ever,
the slow-POST attack; a whole-body deadline bounds every connection's life before its request
reaches the app by the sum of the two timeouts. It asks a client to send --max-body-bytes within
the body timeout (32 MB in 60 s: 0.55 MB/s).

--max-connections caps the open connections of a worker process below its open-files limit
(raised to the hard limit at start). Past the cap a new connection first makes room by closing the
connection that has waited longest with no request in flight (nginx reuses such connections the
same way): first among those that have never been answered (idle since their opening, or their
headers not yet complete: what an idle or slowloris flood holds), and only when there are none
among the kept-alive ones between requests; so a flood of idle or slowloris connections can lock
no real client out, nor close a real client's kept-alive connection while it churns. Only when
every connection has a request in flight is the new one answered 503 + Retry-After naming the
option, then closed after its request has been read for a moment (a lingering close: closing with
unread input sends a reset, which can destroy the answer before the client reads it).

Cost on the request path: one timer handle armed at the end of the headers and cancelled at the
end of the body, and a dict insert/delete (the idle order); nothing per byte.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pergola.gateway.errors import RETRY_AFTER_S, GatewayError
from pergola.gateway.options import GatewayOptions

log = logging.getLogger("pergola.gateway")
LINGER_S = 1.0  # how long a refused connection's input is read and dropped before it is closed
MAX_LINGERING = 1024  # past this many lingering at once, close at once (a reset) rather than hold more files


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit (each connection is a file);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # (a kernel's nr_open below an infinite hard limit)
            pass
    return soft


def default_max_connections(open_files: int) -> int:
    """The cap below `open_files` that leaves room for what else the process opens: connections
    to Triton (gRPC channels, the HTTP pool), tokenizer and metrics files, logs. An eighth of
    the limit, at least 1,024 files (or half of a small limit)."""
    return open_files - max(open_files // 8, min(1024, open_files // 2))


@dataclass(frozen=True)
class ConnectionLimits:
    header_s: float
    body_s: float
    max_connections: int

    @classmethod
    def of(cls, opts: GatewayOptions, open_files: int) -> ConnectionLimits:
        """The options' limits (0 connections: default_max_connections); ValueError names a bad one."""
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not getattr(opts, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be above 0, got {getattr(opts, name)}")
        if opts.max_connections < 0:
            raise ValueError(f"--max-connections must be 0 (from the open-files limit) or more, "
                             f"got {opts.max_connections}")
        cap = opts.max_connections or default_max_connections(open_files)
        return cls(opts.header_timeout_s, opts.body_timeout_s, cap)


def configure(opts: GatewayOptions) -> ConnectionLimits:
    """Set this process's limits for GuardedProtocol (each worker process calls it before serving)."""
    GuardedProtocol.limits = ConnectionLimits.of(opts, raise_open_files_limit())
    return GuardedProtocol.limits


def raw_response(status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: for answers given outside any route
    (no route, so OpenAI's error envelope, the most read one)."""
    body = orjson.dumps(GatewayError(status, message).body("openai"))
    head = [STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join(head) + b"\r\n" + body


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the clocks and the cap of this module's docstring."""

    limits: ClassVar[ConnectionLimits]  # set by configure() in each process
    # Connections with no request in flight, the longest waiting first (dicts keep insertion order):
    # those never answered yet (the first to make room), and the kept-alive ones between requests.
    fresh: ClassVar[dict[GuardedProtocol, None]] = {}
    kept: ClassVar[dict[GuardedProtocol, None]] = {}
    lingering: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None  # the header or body clock
        self.closing_after_answer = False
        self.answered = False  # one response completed on this connection

    # -- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self.make_room():
            self.refuse()
            return
        self.await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.not_idle()
        if self.closing_after_answer:
            self.closing_after_answer = False
            GuardedProtocol.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.closing_after_answer:
            return  # (read and dropped until the client closes or the linger ends)
        if self.deadline is None and self.timeout_keep_alive_task is not None:
            self.await_headers()  # the next request's first byte: its headers' clock starts
        super().data_received(data)

    # -- parser callbacks (uvicorn's, plus the clocks)
    def on_headers_complete(self) -> None:
        self.not_idle()
        self.arm(self.limits.body_s, self.body_expired)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self.cycle is not None and self.cycle.response_complete:
            self.await_headers()  # the body of a request answered early (401, 413): now idle
        else:
            self.disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.answered = True
        if self.timeout_keep_alive_task is not None and self.deadline is None:
            self.kept[self] = None  # idle under uvicorn's keep-alive clock

    # -- clocks
    def arm(self, seconds: float, expired: Callable[[], None]) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.loop.call_later(seconds, expired)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def await_headers(self) -> None:
        self.arm(self.limits.header_s, self.headers_expired)
        # (an idle keep-alive connection keeps its place)
        (self.kept if self.answered else self.fresh).setdefault(self, None)

    def not_idle(self) -> None:
        self.fresh.pop(self, None)
        self.kept.pop(self, None)

    def headers_expired(self) -> None:
        self.deadline = None
        self.not_idle()
        self.transport.close()

    def body_expired(self) -> None:
        """408 while the app still waits for the body (its receive() then says the client is
        gone); a connection already answered is only closed."""
        self.deadline = None
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        log.info("%s %s: the request body did not arrive within %.0f s (--body-timeout-s); answered 408",
                 cycle.scope["method"], cycle.scope["path"], self.limits.body_s)
        cycle.disconnected = True
        cycle.message_event.set()
        self.answer_and_close(raw_response(408, f"the request body did not arrive within "
                                                f"{self.limits.body_s:g} s of its headers (--body-timeout-s)"))

    # -- the cap
    def make_room(self) -> bool:
        """Close the connection idle longest, a never-answered one first, if any; True when one was closed."""
        victim = next(iter(self.fresh), None) or next(iter(self.kept), None)
        if victim is None:
            return False
        victim.not_idle()
        victim.disarm()
        self.connections.discard(victim)  # (at once: more connections may arrive before its loss is seen)
        victim.transport.close()
        return True

    def refuse(self) -> None:
        self.connections.discard(self)
        n = self.limits.max_connections
        message = (f"the gateway holds its limit of {n:,} open connections (--max-connections), each with a "
                   f"request in flight: retry in {RETRY_AFTER_S} s, or raise the limit")
        self.answer_and_close(raw_response(503, message, ((b"retry-after", str(RETRY_AFTER_S).encode()),)))

    def answer_and_close(self, answer: bytes) -> None:
        """Write `answer`, end our side, drop what the client still sends for LINGER_S, then close."""
        self.disarm()
        self._unset_keepalive_if_required()
        self.not_idle()
        self.transport.write(answer)
        if GuardedProtocol.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.closing_after_answer = True
        GuardedProtocol.lingering += 1
        self.flow.resume_reading()
        self.transport.write_eof()
        self.deadline = self.loop.call_later(LINGER_S, self.transport.close)


def listen(host: str, port: int, command: str = "pergola gateway", backlog: int = 2048) -> socket.socket:
    """The gateway's listening socket, or SystemExit (from `command`) saying which port is taken and
    which option picks another (uvicorn alone logs one line, and under `pergola serve` the gateway
    child was left defunct beside a running Triton)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        if sock is not None:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"{command}: port {port} is in use on {host} (another program listens "
                             f"there): pick another with --gateway-port") from None
        raise SystemExit(f"{command}: cannot listen on {host}:{port} ({e.strerror}): check "
                         f"--gateway-bind and --gateway-port") from None
    sock.set_inheritable(True)  # (worker processes serve it)
    return sock


def preflight(opts: GatewayOptions, command: str) -> None:
    """What would stop the gateway at its start, checked by `command` before it starts anything
    else: its connection limits (ValueError) and its port (SystemExit)."""
    ConnectionLimits.of(opts, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    listen(opts.gateway_bind, opts.gateway_port, command).close()
