"""What the gateway's Triton call costs by transport, and what its HTTP/Starlette side costs.

    python perf/experiments/bench_gateway_transport.py --n 1000 --warmup 100 --rounds 4 \
        --out perf/out/gateway_transport.json

One tritonserver (qwen3-tiny, CPU) as in perf/bench_gateway.py. Every variant runs in a fresh
process of its own (the gRPC environment knobs are read at import), makes `--warmup` and then
`--n` sequential batch-1 calls of bench_encoder (128 pre-tokenized INPUT_IDS + LENGTHS ->
EMBEDDING) and reports the round trip (p50/p99) and the process's CPU time per call
(time.process_time(): every thread of the process, gRPC's own included). Each round runs every
variant once, every other round in reverse order; the table gives the medians over the rounds.

  sync_tritonclient   floor: tritonclient.grpc in a plain loop, no asyncio
  sync_raw            floor: grpc's sync stub with a hand-built ModelInferRequest
  aio_tritonclient    tritonclient.grpc.aio on uvloop, the gateway's channel (replicas.connect)
                      and call arguments (client_timeout, Triton timeout)
  aio_tritonclient_asyncio   the same on asyncio's own loop
  aio_..._poll / _fork0   the same with GRPC_POLL_STRATEGY=poll, GRPC_ENABLE_FORK_SUPPORT=0
                      (GRPC_ASYNCIO_ENGINE=custom_io_manager: grpcio 1.85 refuses it, "Unsupported
                      engine type", so the poller thread is the only engine)
  executor_tritonclient  tritonclient.grpc sync client via loop.run_in_executor (4 threads), uvloop
  future_tritonclient    tritonclient.grpc async_infer (the sync stack's future) -> the loop via
                      call_soon_threadsafe, uvloop
  future_raw          grpc's sync stub .future() with a hand-built request -> the loop, uvloop
  http_aio            tritonclient.http.aio (aiohttp), binary tensors, uvloop
  httptools_aio       Triton HTTP with binary tensors on one keep-alive connection: an asyncio
                      Protocol + httptools response parser, all on the loop thread, uvloop
  raw_aio             grpc.aio stub, hand-built ModelInferRequest (raw_input_contents), uvloop
The gateway side (same ids, `POST /v1/embeddings` with 128 token ids):
  backend_real        the gateway's Gateway.model + Backend.embed_tokens called directly, uvloop
                      (inference to Triton's HTTP port, the default since 2026-12-05)
  backend_grpc        the same with --triton-http-port 0 (inference over tritonclient.grpc.aio)
  asgi_real           the gateway app called in process (ASGI, no HTTP), real backend, uvloop
  asgi_stub           the same with Backend.embed_tokens stubbed (a fixed vector, no Triton call)
  asgi_stub_nomw      ...and without pergola's RequestMetrics and TraceContext middlewares
  http_gateway        the real gateway process (uvicorn) over HTTP from http.client; CPU is the
                      gateway process's (/proc/PID/stat), not the client's; blocks of 10 requests
                      take turns with 10 direct tritonclient.grpc calls from the same client
                      (http_gateway_direct, the paired floor; its CPU is this client's)
  http_gateway_grpc   the same gateway with --triton-http-port 0 (inference over gRPC)
  http_gateway_stub   the same gateway with Backend.embed_tokens stubbed
  interleaved         (rows il_*) sync_*, aio_tritonclient, raw_aio, http_aio, executor_tritonclient,
                      future_raw, backend_real and asgi_real in one uvloop process, taking turns in
                      blocks of 10 calls: paired under the same drift of this machine's speed (the
                      sync clients block the loop's thread; --n calls each)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "python_models"))

MODEL = "bench_encoder"
CHILD_VARIANTS = {
    "sync_tritonclient": {}, "sync_raw": {},
    "aio_tritonclient": {}, "aio_tritonclient_asyncio": {},
    "aio_tritonclient_poll": {"GRPC_POLL_STRATEGY": "poll"},
    "aio_tritonclient_fork0": {"GRPC_ENABLE_FORK_SUPPORT": "0"},
    "executor_tritonclient": {}, "future_tritonclient": {}, "future_raw": {},
    "http_aio": {}, "raw_aio": {}, "httptools_aio": {},
    "backend_real": {}, "backend_grpc": {}, "asgi_real": {}, "asgi_stub": {}, "asgi_stub_nomw": {},
    "interleaved": {},
}


def summary(ms: list[float], cpu_s: float, n: int) -> dict:
    a = np.asarray(ms)
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "mean_ms": float(a.mean()), "cpu_ms_per_call": cpu_s / n * 1e3, "n": n}


# --- the child: one variant, one process -----------------------------------------------------
def raw_request(ids: np.ndarray, lengths: np.ndarray):
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=MODEL)
    for name, arr, dtype in (("INPUT_IDS", ids, "INT64"), ("LENGTHS", lengths, "INT32")):
        t = req.inputs.add()
        t.name, t.datatype = name, dtype
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    req.outputs.add().name = "EMBEDDING"
    return req


def raw_vector(resp) -> np.ndarray:
    return np.frombuffer(resp.raw_output_contents[0], dtype=np.float32)


def tc_inputs(mod, ids: np.ndarray, lengths: np.ndarray, **kw):
    a = mod.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    a.set_data_from_numpy(ids, **kw)
    b = mod.InferInput("LENGTHS", list(lengths.shape), "INT32")
    b.set_data_from_numpy(lengths, **kw)
    return [a, b]


def time_sync(call, warmup: int, n: int) -> dict:
    for _ in range(warmup):
        call()
    ms, c0 = [], time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t0) * 1e3)
    return summary(ms, time.process_time() - c0, n)


async def time_async(call, warmup: int, n: int) -> dict:
    for _ in range(warmup):
        await call()
    ms, c0 = [], time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        ms.append((time.perf_counter() - t0) * 1e3)
    return summary(ms, time.process_time() - c0, n)


def sync_call(variant: str, grpc_url: str, ids, lengths):
    if variant == "sync_tritonclient":
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(grpc_url)
        return lambda: client.infer(MODEL, tc_inputs(mod, ids, lengths)).as_numpy("EMBEDDING")
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_url))
    return lambda: raw_vector(stub.ModelInfer(raw_request(ids, lengths)))


def child(variant: str, grpc_url: str, http_url: str, ids_file: str, warmup: int, n: int) -> dict:
    ids = np.load(ids_file)[None, :].astype(np.int64)
    lengths = np.array([[ids.shape[1]]], dtype=np.int32)
    if variant.startswith("sync_"):
        return time_sync(sync_call(variant, grpc_url, ids, lengths), warmup, n)
    if variant != "aio_tritonclient_asyncio":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(async_child(variant, grpc_url, http_url, ids, lengths, warmup, n))


async def async_child(variant: str, grpc_url: str, http_url: str, ids, lengths, warmup: int, n: int) -> dict:
    if variant == "interleaved":
        return await interleaved(grpc_url, http_url, ids, lengths, warmup, n)
    call, close = await make_call(variant, grpc_url, http_url, ids, lengths)
    out = await time_async(call, warmup, n)
    if close is not None:
        await close()
    return out


async def make_call(variant: str, grpc_url: str, http_url: str, ids, lengths):
    """-> (an async function making one call, an async close or None)."""
    loop = asyncio.get_running_loop()
    if variant.startswith("aio_tritonclient"):
        import tritonclient.grpc.aio as mod
        from pergola.gateway.replicas import connect

        client = connect(grpc_url)
        outputs = [mod.InferRequestedOutput("EMBEDDING")]

        async def call():
            r = await client.infer(MODEL, tc_inputs(mod, ids, lengths), outputs=outputs, client_timeout=60.0,
                                   timeout=60_000_000)
            return r.as_numpy("EMBEDDING")
        return call, client.close
    if variant == "executor_tritonclient":
        from concurrent.futures import ThreadPoolExecutor

        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(grpc_url)
        pool = ThreadPoolExecutor(4)

        def blocking():
            return client.infer(MODEL, tc_inputs(mod, ids, lengths), client_timeout=60.0,
                                timeout=60_000_000).as_numpy("EMBEDDING")
        return (lambda: loop.run_in_executor(pool, blocking)), None
    if variant == "future_tritonclient":
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(grpc_url)

        def call():
            fut = loop.create_future()

            def done(result, error):
                loop.call_soon_threadsafe(_settle, fut, result, error)
            client.async_infer(MODEL, tc_inputs(mod, ids, lengths), done, client_timeout=60.0, timeout=60_000_000)
            return fut

        async def one():
            return (await call()).as_numpy("EMBEDDING")
        return one, None
    if variant == "future_raw":
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_url))

        def call():
            fut = loop.create_future()
            stub.ModelInfer.future(raw_request(ids, lengths), timeout=60.0).add_done_callback(
                lambda f: loop.call_soon_threadsafe(_settle_grpc, fut, f))
            return fut

        async def one():
            return raw_vector(await call())
        return one, None
    if variant == "http_aio":
        import tritonclient.http.aio as mod

        client = mod.InferenceServerClient(http_url)
        outputs = [mod.InferRequestedOutput("EMBEDDING", binary_data=True)]

        async def call():
            r = await client.infer(MODEL, tc_inputs(mod, ids, lengths, binary_data=True), outputs=outputs,
                                   timeout=60_000_000)
            return r.as_numpy("EMBEDDING")
        return call, client.close
    if variant == "httptools_aio":
        host, port = http_url.rsplit(":", 1)
        conn = await RawHTTP.open(host, int(port))
        path = f"/v2/models/{MODEL}/infer"
        return (lambda: conn.infer(path, ids, lengths)), conn.close
    if variant == "raw_aio":
        from pergola.gateway.replicas import connect

        client = connect(grpc_url)  # the gateway's channel; its stub called directly
        stub = client._client_stub

        async def call():
            return raw_vector(await stub.ModelInfer(raw_request(ids, lengths), timeout=60.0))
        return call, client.close
    if variant in ("backend_real", "backend_grpc"):
        from pergola.gateway.backend import EmbedOptions
        from pergola.gateway.offload import token_ids
        from pergola.gateway.options import GatewayOptions
        from pergola.gateway.state import Gateway

        http_port = "0" if variant == "backend_grpc" else http_url.rsplit(":", 1)[1]
        gw = Gateway(GatewayOptions(triton=grpc_url, triton_http_port=http_port, models="bench"))
        as_list = token_ids([ids[0].tolist()], "input")

        async def call():
            model = await gw.model("bench", "embed")
            return (await gw.backend.embed_tokens(model, as_list, EmbedOptions())).vectors
        return call, gw.pool.close
    if variant.startswith("asgi_"):
        return await asgi(variant, grpc_url, http_url, ids)
    raise SystemExit(f"unknown variant {variant}")


class RawHTTP(asyncio.Protocol):
    """Triton's HTTP/REST door with the binary-data extension, on one keep-alive connection, all
    on the loop's thread: httptools' response parser over an asyncio Protocol (no poller thread,
    no aiohttp session machinery)."""

    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.header_len = 0

    @classmethod
    async def open(cls, host: str, port: int) -> "RawHTTP":
        _, proto = await asyncio.get_running_loop().create_connection(cls, host, port)
        return proto

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"inference-header-content-length":
            self.header_len = int(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        self.waiter.set_result((self.parser.get_status_code(), self.header_len, body))

    async def infer(self, path: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        head = json.dumps({"inputs": [
            {"name": "INPUT_IDS", "shape": list(ids.shape), "datatype": "INT64",
             "parameters": {"binary_data_size": ids.nbytes}},
            {"name": "LENGTHS", "shape": list(lengths.shape), "datatype": "INT32",
             "parameters": {"binary_data_size": lengths.nbytes}}],
            "outputs": [{"name": "EMBEDDING", "parameters": {"binary_data": True}}]}).encode()
        n = len(head) + ids.nbytes + lengths.nbytes
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines([
            f"POST {path} HTTP/1.1\r\nHost: triton\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\nContent-Length: {n}\r\n\r\n".encode(),
            head, ids.tobytes(), lengths.tobytes()])
        status, header_len, body = await self.waiter
        if status != 200:
            raise RuntimeError(body[:300])
        return np.frombuffer(body, dtype=np.float32, offset=header_len)

    async def close(self) -> None:
        self.transport.close()


def _settle(fut: asyncio.Future, result, error) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


def _settle_grpc(fut: asyncio.Future, f) -> None:
    if not fut.done():
        e = f.exception()
        fut.set_exception(e) if e is not None else fut.set_result(f.result())


def stub_backend(dim: int = 64) -> None:
    """Backend.embed_tokens answers a fixed vector per input, without Triton."""
    from pergola.gateway.backend import Backend, Embedded

    vec = np.random.default_rng(0).standard_normal((1, dim)).astype(np.float32)

    async def embed_tokens(self, model, ids, opts):
        return Embedded(np.repeat(vec, len(ids), axis=0), np.array([len(t) for t in ids], dtype=np.int32))
    Backend.embed_tokens = embed_tokens


async def asgi(variant: str, grpc_url: str, http_url: str, ids: np.ndarray):
    from pergola.gateway.app import build_app
    from pergola.gateway.options import GatewayOptions

    if variant != "asgi_real":
        stub_backend()
    app = build_app(GatewayOptions(triton=grpc_url, triton_http_port=http_url.rsplit(":", 1)[1], models="bench"))
    if variant == "asgi_stub_nomw":
        app.user_middleware = []  # (Starlette builds its stack on the first call)
    body = json.dumps({"model": "bench", "input": [ids[0].tolist()]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}

    async def call():
        sent = False
        status = []

        async def receive():
            nonlocal sent
            if sent:
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
        await app(dict(scope), receive, send)
        if status != [200]:
            raise RuntimeError(f"the app answered {status}")

    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    return call, lambda: lifespan.__aexit__(None, None, None)


# In one process, the transports that can share it take turns in blocks of BLOCK calls, so that
# the machine's drift falls on all of them alike. The sync clients block the loop's thread.
INTERLEAVED = ["sync_tritonclient", "sync_raw", "aio_tritonclient", "raw_aio", "http_aio", "httptools_aio",
               "executor_tritonclient", "future_raw", "backend_real", "backend_grpc", "asgi_real"]
BLOCK = 10


async def interleaved(grpc_url: str, http_url: str, ids, lengths, warmup: int, n: int) -> dict:
    calls = {}
    for v in INTERLEAVED:
        if v.startswith("sync_"):
            call = sync_call(v, grpc_url, ids, lengths)
            calls[v] = (lambda call=call: _done(call()), None)
        else:
            calls[v] = await make_call(v, grpc_url, http_url, ids, lengths)
    for call, _ in calls.values():
        for _ in range(warmup):
            await call()
    ms: dict[str, list[float]] = {v: [] for v in calls}
    cpu = dict.fromkeys(calls, 0.0)
    for _ in range(n // BLOCK):
        for v, (call, _) in calls.items():
            c0 = time.process_time()
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                await call()
                ms[v].append((time.perf_counter() - t0) * 1e3)
            cpu[v] += time.process_time() - c0
    for _, close in calls.values():
        if close is not None:
            await close()
    return {v: summary(ms[v], cpu[v], len(ms[v])) for v in calls}


async def _done(value):
    return value


# --- the parent: Triton, the gateway over HTTP, the table ---------------------------------------
def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_stub(opts_json: str) -> None:
    """`pergola gateway` with Backend.embed_tokens stubbed (the http_gateway_stub row)."""
    from pergola.gateway import app
    from pergola.gateway.options import GatewayOptions

    stub_backend()
    app.run(GatewayOptions(**json.loads(opts_json)))


def http_gateway(grpc_url: str, http_url: str, ids: np.ndarray, warmup: int, n: int, stub: bool,
                 over_grpc: bool = False) -> dict:
    from bench_gateway import Gateway, _first_answer
    from pergola.gateway.app import spawn
    from pergola.gateway.options import GatewayOptions
    from pergola.server import free_port

    port = free_port()
    opts = GatewayOptions(triton=grpc_url, triton_http_port="0" if over_grpc else http_url.rsplit(":", 1)[1],
                          gateway_port=port, gateway_bind="127.0.0.1", models="bench")
    if stub:
        proc = subprocess.Popen([sys.executable, __file__, "--serve-stub", json.dumps(opts.__dict__)])
    else:
        proc = spawn(opts)
    try:
        if _first_answer(port, deadline=time.monotonic() + 60) is None:
            return {"error": "the gateway did not answer"}
        gw = Gateway(port)
        body = [ids.tolist()]
        direct = sync_call("sync_tritonclient", grpc_url, ids[None, :], np.array([[ids.size]], dtype=np.int32))
        for _ in range(warmup):
            gw.embed(body)
            direct()
        # blocks of BLOCK gateway requests and BLOCK direct calls (tritonclient.grpc, this process)
        # take turns: the gateway's added time, paired under the same drift
        ms, ms_direct, cpu, cpu_direct = [], [], 0.0, 0.0
        for _ in range(n // BLOCK):
            c0 = proc_cpu_s(proc.pid)
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                gw.embed(body)
                ms.append((time.perf_counter() - t0) * 1e3)
            cpu += proc_cpu_s(proc.pid) - c0
            c0 = time.process_time()
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                direct()
                ms_direct.append((time.perf_counter() - t0) * 1e3)
            cpu_direct += time.process_time() - c0
        out = summary(ms, cpu, len(ms)) | {"cpu_is": "the gateway process"}
        return out | {"paired_direct": summary(ms_direct, cpu_direct, len(ms_direct)),
                      "added_p50_ms": out["p50_ms"] - float(np.percentile(ms_direct, 50))}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_ids(workdir: Path) -> tuple[Path, np.ndarray]:
    """qwen3-tiny's folder under `workdir` (CPU) and the 128 token ids every call sends."""
    import common
    from common import model_folder
    from inputs import TokenWindows
    from pergola.hf_folder import load_model_spec

    common.DEVICE = "cpu"
    folder = model_folder("qwen3-tiny", workdir)
    return folder, TokenWindows(load_model_spec(folder).tokenizer_file).ids(128, 1, seed=1)[0].astype(np.int64)


def record(variants: dict, name: str, last: dict) -> None:
    """One round's row of a variant, kept and printed."""
    variants.setdefault(name, {"rounds": []})["rounds"].append(last)
    if "error" in last:
        print(f"  {name:28s} failed: {last['error'][-300:]}", flush=True)
    else:
        print(f"  {name:28s} p50 {last['p50_ms']:6.3f} ms  p99 {last['p99_ms']:6.3f}  "
              f"cpu {last['cpu_ms_per_call']:6.3f} ms/call", flush=True)


def medians(variants: dict, extra: tuple[str, ...] = ()) -> None:
    """Each variant's medians over its rounds into row["median"] (this machine's speed drifts
    between rounds; the order alternates), and their table; `extra`: more keys of a round's row."""
    print(f"\n{'variant':28s} {'p50 ms':>8s} {'p50 range':>15s} {'p99 ms':>8s} {'cpu ms/call':>12s} {'cpu range':>15s}"
          + "".join(f" {k:>14s}" for k in extra))
    for v, row in variants.items():
        ok = [x for x in row["rounds"] if "error" not in x]
        if not ok:
            print(f"{v:28s} failed")
            continue
        p50, p99, cpu = ([x[k] for x in ok] for k in ("p50_ms", "p99_ms", "cpu_ms_per_call"))
        more = {k: float(np.median([x[k] for x in ok])) for k in extra if all(k in x for x in ok)}
        row["median"] = {"p50_ms": float(np.median(p50)), "p99_ms": float(np.median(p99)),
                         "cpu_ms_per_call": float(np.median(cpu)), **more, "rounds": len(ok)}
        m = row["median"]
        print(f"{v:28s} {m['p50_ms']:8.3f} {min(p50):7.3f}-{max(p50):<7.3f} {m['p99_ms']:8.3f} "
              f"{m['cpu_ms_per_call']:12.3f} {min(cpu):7.3f}-{max(cpu):<7.3f}"
              + "".join(f" {more[k]:14.3f}" if k in more else f" {'':14s}" for k in extra))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2, help="every variant once per round")
    p.add_argument("--variants", nargs="*", default=None, help="a subset (default: all)")
    p.add_argument("--out", default="perf/out/gateway_transport.json")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve-stub", default=None, help=argparse.SUPPRESS)
    p.add_argument("--grpc-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--http-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_stub:
        return serve_stub(args.serve_stub)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.grpc_url, args.http_url, args.ids_file, args.warmup,
                                           args.n)), flush=True)
        return

    from bench_gateway import pergola_stack
    from common import write_result

    workdir = Path(tempfile.mkdtemp(prefix="pergola-transport-"))
    folder, ids = bench_ids(workdir)
    ids_file = workdir / "ids.npy"
    np.save(ids_file, ids)
    wanted = args.variants or [*CHILD_VARIANTS, "http_gateway", "http_gateway_grpc", "http_gateway_stub"]
    res: dict = {"model": "qwen3-tiny", "device": "cpu", "tokens": 128, "n": args.n, "warmup": args.warmup,
                 "cores": os.cpu_count(), "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variants": {}}
    with pergola_stack(folder, workdir, False, gateway=False, max_queue_seconds=0.0) as (opts, _):
        grpc_url, http_url = f"127.0.0.1:{opts.grpc_port}", f"127.0.0.1:{opts.http_port}"
        def one(v: str) -> dict:
            if v.startswith("http_gateway"):
                return http_gateway(grpc_url, http_url, ids, args.warmup, args.n, stub=v.endswith("stub"),
                                    over_grpc=v.endswith("grpc"))
            proc = subprocess.run([sys.executable, __file__, "--child", v, "--grpc-url", grpc_url, "--http-url",
                                   http_url, "--ids-file", str(ids_file), "--warmup", str(args.warmup),
                                   "--n", str(args.n)], check=False, env=dict(os.environ) | CHILD_VARIANTS[v],
                                  capture_output=True, text=True, timeout=600)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            return json.loads(lines[-1][7:]) if lines else {"error": (proc.stderr or proc.stdout)[-600:]}

        for r in range(args.rounds):  # every other round in reverse order (drift shows as a difference)
            print(f"round {r + 1}", flush=True)
            for v in (wanted if r % 2 == 0 else wanted[::-1]):
                got = one(v)
                rows = {f"il_{k}": x for k, x in got.items()} if v == "interleaved" and "error" not in got else {v: got}
                if "paired_direct" in got:
                    rows[f"{v}_direct"] = got.pop("paired_direct")
                for name, last in rows.items():
                    record(res["variants"], name, last)
    medians(res["variants"])
    write_result(res, args.out)


if __name__ == "__main__":
    main()
