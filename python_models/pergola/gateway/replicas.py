"""The Triton servers behind the gateway, and how a call picks one (Ivy's fan-out).

Each call goes to the replica with the fewest calls outstanding from this process (ties: the
one used longest ago), so a request cut into chunks spreads its chunks over every replica. A
replica that refuses for overload or cannot be reached is skipped for the rest of that call and
the chunk is tried on the next one; one that cannot be reached is also left out of new calls
for `down_s` seconds. A name that resolves to several addresses (a Kubernetes headless Service)
is one replica per address, resolved again every `resolve_every_s`.

Inference goes to each replica's HTTP port (gateway/triton_http.py: less of the gateway's CPU
per call than gRPC, measured there) unless its HTTP port is 0; readiness, model configs and the
repository index go over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from pergola.gateway.errors import GatewayError, from_triton
from pergola.gateway.triton_http import TritonHTTP

log = logging.getLogger("pergola.gateway")
T = TypeVar("T")
_ticket = itertools.count()
# Seconds a control call (readiness, model configs, the repository index) may take: one that
# hangs (a replica half up, a connection stuck) must not hold every request behind the catalog.
CONTROL_TIMEOUT_S = 5.0


def connect(address: str) -> grpcaio.InferenceServerClient:
    """A client for one replica. tritonclient's channel options, plus a reconnect backoff capped
    at one second: gRPC's default grows to 120 s, so a replica that came up after the gateway
    (a Triton server still loading its models) could wait minutes for its first call."""
    options = grpcaio.KeepAliveOptions()
    return grpcaio.InferenceServerClient(address, channel_args=[
        ("grpc.max_send_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", grpcaio.MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", options.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", options.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", options.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", options.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ])


@dataclass
class Replica:
    address: str  # HOST:PORT (gRPC)
    client: grpcaio.InferenceServerClient
    http: TritonHTTP | None = None  # inference over HTTP, when the replica's HTTP port is known
    outstanding: int = 0
    last_used: int = 0
    down_until: float = 0.0


def split_target(target: str) -> tuple[str, str]:
    """HOST:PORT -> (HOST, PORT); ValueError naming --triton otherwise."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--triton takes HOST:PORT (Triton's gRPC port, 8001 by default), got {target!r}")
    return host, port


def resolve(target: str) -> list[str]:
    """HOST:PORT -> one HOST:PORT per address the name resolves to (itself if it is an address,
    or if it does not resolve now: the call will say why)."""
    host, port = split_target(target)
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [target]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return [target]
    addresses = sorted({info[4][0] for info in infos})
    if len(addresses) <= 1:
        return [target]
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses]


def http_ports(spec: str, targets: list[str]) -> list[int]:
    """--triton-http-port (one port for every target, or one per target) -> a port per target."""
    try:
        ports = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--triton-http-port takes port numbers separated by commas, got {spec!r}") from None
    if len(ports) == 1:
        return ports * len(targets)
    if len(ports) != len(targets):
        raise ValueError(f"--triton-http-port names {len(ports)} ports for {len(targets)} --triton entries: "
                         "give one port for all, or one per entry in the same order")
    return ports


def with_port(address: str, port: int) -> str:
    """HOST:PORT (IPv6 in brackets) -> HOST:`port`."""
    return f"{address.rpartition(':')[0]}:{port}"


def is_connection_error(err: InferenceServerException) -> bool:
    return str(err.status()).endswith("UNAVAILABLE") and "queued tokens" not in err.message() \
        and "maximum queue size" not in err.message()


class ReplicaPool:
    def __init__(self, targets: list[str], http_ports: list[int] | None = None, down_s: float = 2.0,
                 resolve_every_s: float = 10.0) -> None:
        if not targets:
            raise ValueError("no Triton server to send requests to (--triton HOST:PORT)")
        self.targets = targets
        self.http_ports = dict(zip(targets, http_ports or [0] * len(targets)))  # target -> HTTP port (0: none)
        self.down_s = down_s
        self.resolve_every_s = resolve_every_s
        self.replicas: dict[str, Replica] = {}
        self._closing: set[asyncio.Task] = set()
        self._resolved_at = float("-inf")
        self.refresh()

    def refresh(self) -> None:
        """Re-resolve the targets: new addresses join, vanished ones leave (their calls finish)."""
        addresses = {a: self.http_ports[t] for t in self.targets for a in resolve(t)}
        for address, http_port in addresses.items():
            if address not in self.replicas:
                http = TritonHTTP(with_port(address, http_port)) if http_port else None
                self.replicas[address] = Replica(address, connect(address), http)
        for address in set(self.replicas) - set(addresses):
            gone = self.replicas.pop(address)
            with contextlib.suppress(RuntimeError):  # (no running loop: nothing was opened yet)
                task = asyncio.get_running_loop().create_task(_close(gone))
                self._closing.add(task)  # (the loop keeps only a weak reference)
                task.add_done_callback(self._closing.discard)
        self._resolved_at = time.monotonic()

    def _ordered(self) -> list[Replica]:
        if time.monotonic() - self._resolved_at > self.resolve_every_s:
            self.refresh()
        now = time.monotonic()
        return sorted(self.replicas.values(), key=lambda r: (r.down_until > now, r.outstanding, r.last_used))

    async def call(self, fn: Callable[[Replica], Awaitable[T]]) -> T:
        """fn(replica) on the least busy replica; on overload or a lost connection, on the next.
        Raises the GatewayError of the last refusal (429 if any replica was only busy)."""
        errors: list[GatewayError] = []
        for replica in self._ordered():
            replica.outstanding += 1
            replica.last_used = next(_ticket)
            try:
                return await fn(replica)
            except InferenceServerException as e:
                error = from_triton(str(e.status()), e.message())
                if error.status not in (429, 503):
                    raise error from None
                if is_connection_error(e):
                    replica.down_until = time.monotonic() + self.down_s
                    log.warning("Triton at %s: %s; trying another replica", replica.address, e.message())
                errors.append(error)
            finally:
                replica.outstanding -= 1
        busy = [e for e in errors if e.status == 429]
        raise (busy or errors)[-1] if errors else GatewayError(503, "no Triton server is known")

    async def ready(self) -> bool:
        """True when at least one replica answers that it is ready."""
        async def one(replica: Replica) -> bool:
            try:
                return bool(await replica.client.is_server_ready(client_timeout=CONTROL_TIMEOUT_S))
            except InferenceServerException:
                return False

        return any(await asyncio.gather(*(one(r) for r in list(self.replicas.values()))))

    async def close(self) -> None:
        await asyncio.gather(*(_close(r) for r in self.replicas.values()), return_exceptions=True)


async def _close(replica: Replica) -> None:
    if replica.http is not None:
        await replica.http.close()
    await replica.client.close()
