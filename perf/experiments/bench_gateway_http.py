"""The gateway's HTTP round trip by HTTP server: uvicorn (what `pergola gateway` runs) against granian.

    python perf/experiments/bench_gateway_http.py --n 1000 --warmup 100 --rounds 4 \
        --out perf/out/gateway_http.json

One tritonserver (qwen3-tiny, CPU) as in bench_gateway_transport.py, whose helpers this reuses.
Each round starts every server below afresh, one process tree each, twice: first with
Backend.embed_tokens stubbed (a fixed vector, no Triton call: rows `<server>_stub`), then real
against Triton (rows `<server>`). The servers of one phase are measured together: blocks of 10
sequential batch-1 requests (`POST /v1/embeddings`, 128 token ids) take turns over them, and in
the real phase with blocks of 10 direct tritonclient.grpc calls (row `direct`, the paired floor;
`added_p50_ms`: a server's p50 less direct's, per round), so that this machine's drift falls on
all of them alike; every other round in reverse order; the table gives the medians over rounds.
The client is the same for every server: one http.client keep-alive connection each
(bench_gateway.Gateway). Figures: the round trip (p50/p99), the server's CPU per request
(/proc/PID/stat of its process and its children: granian's worker is a child of its
supervisor; for `direct`, this client's) and this client's CPU per request (time.process_time()).

  uvicorn        app.run(): uvicorn with httptools and uvloop (its "auto" picks), 1 process
  uvicorn_h11    the same with http="h11"
  uvicorn_lean   uvicorn as `pergola gateway` runs it, plus proxy_headers=False, server_header=False,
                 date_header=False (no X-Forwarded-* middleware, two headers fewer per answer)
  granian        granian (pip install granian==2.8.7) --interface asgi --loop uvloop --workers 1
                 serving the factory pergola.gateway.app:create_app (options as PERGOLA_* variables);
                 otherwise its defaults (for ASGI its runtime mode "auto" is mt)
  granian_st     ... --runtime-mode st (README: "st mode to be more efficient with a small amount of
                 processes")
  granian_st_h1  ... --runtime-mode st --http 1 --no-ws (no HTTP/2 detection, no websockets)
(granian's --task-impl rust is left out: it falls back to asyncio on Python >= 3.12, the GPU host's.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_transport import (
    BLOCK,
    ROOT,
    bench_ids,
    medians,
    proc_cpu_s,
    record,
    stub_backend,
    summary,
    sync_call,
)

GRANIAN = ["--interface", "asgi", "--loop", "uvloop", "--workers", "1", "--log-level", "warning",
           "--no-access-log"]
SERVERS: dict[str, list[str]] = {
    "uvicorn": [], "uvicorn_h11": ["h11"], "uvicorn_lean": ["lean"],
    "granian": GRANIAN, "granian_st": GRANIAN + ["--runtime-mode", "st"],
    "granian_st_h1": GRANIAN + ["--runtime-mode", "st", "--http", "1", "--no-ws"],
}
EXTRA = ("client_cpu_ms_per_call", "added_p50_ms")


# --- the servers -------------------------------------------------------------------------------
def stub_app():
    """granian's factory for the stub rows: the gateway's app, Backend.embed_tokens stubbed."""
    from pergola.gateway.app import create_app

    stub_backend()
    return create_app()


def serve_uvicorn(http: str, stub: bool, opts_json: str) -> None:
    """app.run() as `pergola gateway` calls it, with uvicorn's `http` implementation set."""
    import uvicorn
    from pergola.gateway import app
    from pergola.gateway.options import GatewayOptions

    if stub:
        stub_backend()
    extra: dict = {}
    for word in filter(None, http.split(",")):
        extra |= ({"proxy_headers": False, "server_header": False, "date_header": False} if word == "lean"
                  else {"http": word})
    if extra:
        plain = uvicorn.run
        uvicorn.run = lambda *a, **kw: plain(*a, **kw, **extra)
    app.run(GatewayOptions(**json.loads(opts_json)))


def launch(server: str, opts, stub: bool) -> subprocess.Popen:
    args = SERVERS[server]
    if server.startswith("uvicorn"):
        return subprocess.Popen([sys.executable, __file__, "--serve-uvicorn", ",".join(args), "--stub", str(int(stub)),
                                 json.dumps(opts.__dict__)])
    from pergola.options import to_environment

    target = "bench_gateway_http:stub_app" if stub else "pergola.gateway.app:create_app"
    path = os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT / "perf"), str(ROOT / "python_models")])
    env = dict(os.environ) | to_environment(opts) | {"PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "granian", *args, "--host", opts.gateway_bind, "--port",
                             str(opts.gateway_port), "--factory", target], env=env)


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += tree(int(child))
    return out


def tree_cpu_s(pids: list[int]) -> float:
    return sum(proc_cpu_s(p) for p in pids)


# --- one phase: the servers (and direct calls) taking turns --------------------------------------
def start(servers: list[str], grpc_url: str, stub: bool) -> dict[str, tuple[subprocess.Popen, int]]:
    from bench_gateway import _first_answer
    from pergola.gateway.options import GatewayOptions
    from pergola.server import free_port

    procs = {}
    for s in servers:
        port = free_port()
        # (inference over gRPC, as when this script's figures were taken; Triton's HTTP port, the
        # default since 2026-12-05, is measured in bench_gateway_transport.py)
        opts = GatewayOptions(triton=grpc_url, triton_http_port="0", gateway_port=port, gateway_bind="127.0.0.1",
                              models="bench")
        procs[s] = (launch(s, opts, stub), port)
    for s, (proc, port) in procs.items():
        if _first_answer(port, deadline=time.monotonic() + 60) is None:
            raise RuntimeError(f"{s} did not answer")
    return procs


def phase(servers: list[str], grpc_url: str, ids: np.ndarray, warmup: int, n: int, stub: bool) -> dict:
    from bench_gateway import Gateway

    procs = start(servers, grpc_url, stub)
    try:
        body = [ids.tolist()]
        calls: dict[str, tuple[Callable[[], object], list[int] | None]] = {
            s: (partial(Gateway(port).embed, body), tree(proc.pid)) for s, (proc, port) in procs.items()}
        if not stub:
            direct = sync_call("sync_tritonclient", grpc_url, ids[None, :], np.array([[ids.size]], dtype=np.int32))
            calls["direct"] = (direct, None)
            check(calls, direct)
        return turns(calls, warmup, n)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            proc.wait(timeout=30)


def check(calls: dict, direct: Callable[[], np.ndarray]) -> None:
    """Every server answers the vector Triton answers."""
    want = np.asarray(direct()).reshape(-1)
    for s, (call, _) in calls.items():
        got = np.asarray(call()).reshape(-1)
        if not np.allclose(got, want, atol=1e-4):
            raise RuntimeError(f"{s} answered another vector")


def turns(calls: dict[str, tuple[Callable[[], object], list[int] | None]], warmup: int, n: int) -> dict:
    for call, _ in calls.values():
        for _ in range(warmup):
            call()
    ms: dict[str, list[float]] = {s: [] for s in calls}
    cpu, client = dict.fromkeys(calls, 0.0), dict.fromkeys(calls, 0.0)
    for _ in range(n // BLOCK):
        for s, (call, pids) in calls.items():
            s0 = tree_cpu_s(pids) if pids else 0.0
            c0 = time.process_time()
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                call()
                ms[s].append((time.perf_counter() - t0) * 1e3)
            client[s] += time.process_time() - c0
            if pids:
                cpu[s] += tree_cpu_s(pids) - s0
    out = {s: summary(ms[s], cpu[s] if calls[s][1] else client[s], len(ms[s])) | {"client_cpu_ms_per_call": client[s] / len(ms[s]) * 1e3}
           for s in calls}
    if "direct" in out:
        for s in calls:
            out[s]["added_p50_ms"] = out[s]["p50_ms"] - out["direct"]["p50_ms"]
    return out


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:  # (only the granian rows need it)
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4, help="every server once per round and phase")
    p.add_argument("--servers", nargs="*", default=list(SERVERS), choices=list(SERVERS))
    p.add_argument("--out", default="perf/out/gateway_http.json")
    p.add_argument("--serve-uvicorn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stub", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("opts_json", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_uvicorn is not None:
        return serve_uvicorn(args.serve_uvicorn, bool(args.stub), args.opts_json)

    from bench_gateway import pergola_stack
    from common import write_result

    workdir = Path(tempfile.mkdtemp(prefix="pergola-http-"))
    folder, ids = bench_ids(workdir)
    res: dict = {"model": "qwen3-tiny", "device": "cpu", "tokens": 128, "n": args.n, "warmup": args.warmup,
                 "cores": os.cpu_count(), "command": " ".join(sys.argv), "granian": _version("granian"),
                 "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "variants": {}}
    with pergola_stack(folder, workdir, False, gateway=False, max_queue_seconds=0.0) as (opts, _):
        grpc_url = f"127.0.0.1:{opts.grpc_port}"
        for r in range(args.rounds):  # every other round in reverse order
            res.setdefault("load_avg_1min", []).append(os.getloadavg()[0])  # (others' work on this machine)
            print(f"round {r + 1} (load average {os.getloadavg()[0]:.2f})", flush=True)
            servers = args.servers if r % 2 == 0 else args.servers[::-1]
            for stub in (True, False):
                got = phase(servers, grpc_url, ids, args.warmup, args.n, stub)
                for s, row in got.items():
                    record(res["variants"], f"{s}_stub" if stub else s, row)
    medians(res["variants"], EXTRA)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
