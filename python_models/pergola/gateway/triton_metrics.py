"""`GET /metrics/triton`: the Prometheus text of every Triton replica's metrics port, passed
through with a `replica` label, so one scrape of the gateway sees the servers behind it (TEI's
/metrics shows its model's queue and timings; Triton's nv_inference_* and pergola's stage
histograms are those). The gateway's own metrics stay at /metrics (gateway/metrics.py).

A replica whose metrics port does not answer is left out and counted in
pergola_gateway_triton_metrics_up{replica} = 0.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pergola.gateway.state import Gateway

PATH = "/metrics/triton"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def metrics_url(address: str, port: int) -> str:
    """Triton's metrics URL on the host of a gRPC `address` (HOST:PORT or [IPv6]:PORT)."""
    host = address.rsplit(":", 1)[0]
    return f"http://{host}:{port}/metrics"


def labelled(text: str, replica: str, described: set[tuple[str, str]]) -> list[str]:
    """`text`'s samples with replica="..." added; HELP / TYPE lines once per metric (`described`)."""
    out = []
    value = replica.replace("\\", "\\\\").replace('"', '\\"')
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if (parts[1], parts[2]) in described:
                    continue
                described.add((parts[1], parts[2]))
            out.append(line)
            continue
        sample = _SAMPLE.match(line)
        if sample is None:
            continue
        name, labels, rest = sample.groups()
        inner = f'replica="{value}"' + ("," + labels[1:-1] if labels and labels != "{}" else "")
        out.append(f"{name}{{{inner}}}{rest}")
    return out


def _fetch(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return answer.read().decode("utf-8", errors="replace")


async def triton_metrics(gw: Gateway, request: Request) -> Response:
    """Every replica's metrics text, labelled by replica (no API key, as /metrics)."""
    addresses = sorted(gw.pool.replicas)
    urls = [metrics_url(a, gw.opts.triton_metrics_port) for a in addresses]
    texts = await asyncio.gather(*(asyncio.to_thread(_fetch, u, 5.0) for u in urls), return_exceptions=True)
    lines: list[str] = []
    described: set[tuple[str, str]] = set()
    up = ["# HELP pergola_gateway_triton_metrics_up 1 when the replica's metrics port answered this scrape",
          "# TYPE pergola_gateway_triton_metrics_up gauge"]
    for address, text in zip(addresses, texts):
        ok = isinstance(text, str)
        up.append(f'pergola_gateway_triton_metrics_up{{replica="{address}"}} {int(ok)}')
        if ok:
            lines += labelled(text, address, described)
    return Response("\n".join(up + lines) + "\n", media_type=CONTENT_TYPE)


def route(gateway: Callable[[], Gateway]) -> Route:
    """The route, its handler bound to the app's gateway (`gateway()` returns it)."""

    async def endpoint(request: Request) -> Response:
        return await triton_metrics(gateway(), request)

    return Route(PATH, endpoint, methods=["GET"])
