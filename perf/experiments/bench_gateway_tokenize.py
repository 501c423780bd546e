"""Where the gateway tokenizes a mid-size text request: through Triton's ensemble, on its event
loop, or on a tokenizing thread (gateway/tokenizers.py).

    python perf/experiments/bench_gateway_tokenize.py --n 600 --out perf/out/gateway_tokenize.json

One tritonserver (qwen3-tiny, CPU) and three gateways in front of it, each its own process:
  ensemble  --gateway-tokenize-chars 0: every text through the `embed` ensemble's tokenizer
  loop      every request tokenized in the gateway on its event loop (INLINE_CHARS raised: the
            behaviour before tokenizing threads, for requests up to --gateway-tokenize-chars)
  thread    the default: up to INLINE_CHARS on the loop, longer requests on a tokenizing thread
Two phases:
  latency   a 2,500-character text, batch 1, sequential, the gateways taking turns in blocks of
            10 (bench_gateway.time_paired), real Triton behind them; answers checked equal
  blocking  Triton's answer stubbed (2 ms, a fixed vector: the gateway alone), each gateway in
            turn: an 8-word query's latency idle, then while 4 client threads send 2,500-character
            texts back to back; their texts per second. Shows whether tokenizing holds the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))
from bench_gateway import Gateway, _first_answer, pergola_stack, time_paired, tokenizes_texts  # noqa: E402
from common import model_folder, percentiles, write_result  # noqa: E402
from mixed import QUERY  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog near the riverbank. " * 40)[:2500]
VARIANTS = ("ensemble", "loop", "thread")


def serve(port: int, grpc_url: str, repo: str, variant: str, stub: bool) -> None:
    """One gateway (the child process's body)."""
    from pergola.gateway import app, tokenizers
    from pergola.gateway.backend import Backend
    from pergola.gateway.options import GatewayOptions

    if variant == "loop":
        tokenizers.INLINE_CHARS = 1 << 30
    if stub:
        class Answer:
            def __init__(self, n: int) -> None:
                self.n = n

            def as_numpy(self, name: str) -> np.ndarray:
                return np.full(self.n, 512, np.int32) if name == "TOKEN_COUNT" else np.ones((self.n, 64), np.float32)

        async def infer(self, model, inputs, outputs, version=""):
            await asyncio.sleep(0.002)  # the GPU's share, roughly
            return Answer(next(i.array.shape for i in inputs if i.name in ("LENGTHS", "TEXT"))[-1])
        Backend._infer = infer
    # (inference over gRPC, as when this script's figures were taken)
    app.run(GatewayOptions(triton=grpc_url, triton_http_port="0", gateway_port=port, gateway_bind="127.0.0.1",
                           models="bench",
                           triton_repository=repo, gateway_tokenize_chars=0 if variant == "ensemble" else 1 << 20))


def launch(variant: str, grpc_url: str, repo: Path, stub: bool) -> tuple[subprocess.Popen, int]:
    from pergola.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port), "--grpc-url", grpc_url,
                             "--repo", str(repo)] + (["--stub"] if stub else []))
    if _first_answer(port, time.monotonic() + 60) is None:
        raise RuntimeError(f"the {variant} gateway did not answer")
    if variant != "ensemble" and not tokenizes_texts(port):
        raise RuntimeError(f"the {variant} gateway never tokenized a text itself")
    return proc, port


def latency(grpc_url: str, repo: Path, n: int) -> dict:
    gateways = {v: launch(v, grpc_url, repo, stub=False) for v in VARIANTS}
    try:
        clients = {v: Gateway(port) for v, (_, port) in gateways.items()}
        answers = {v: c.embed(TEXT) for v, c in clients.items()}
        diff = max(float(np.abs(answers[v] - answers["ensemble"]).max()) for v in VARIANTS)
        res = time_paired({v: (lambda x, c=c: c.embed(x[0], base64_out=True)) for v, c in clients.items()},
                          [[TEXT]], n)
        return res | {"max_abs_diff_vs_ensemble": diff}
    finally:
        for proc, _ in gateways.values():
            proc.terminate()


def blocking(grpc_url: str, repo: Path, n: int, clients: int = 4) -> dict:
    out = {}
    for variant in VARIANTS:
        proc, port = launch(variant, grpc_url, repo, stub=True)
        try:
            gw = Gateway(port)

            def queries() -> dict:
                ms = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    gw.embed(QUERY, base64_out=True)
                    ms.append((time.perf_counter() - t0) * 1e3)
                return percentiles(ms)

            idle = queries()
            stop, sent = threading.Event(), []

            def bulk() -> None:
                client = Gateway(port)
                while not stop.is_set():
                    client.embed(TEXT, base64_out=True)
                    sent.append(1)

            threads = [threading.Thread(target=bulk) for _ in range(clients)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            before, t0 = len(sent), time.perf_counter()
            loaded = queries()
            rate = (len(sent) - before) / (time.perf_counter() - t0)
            stop.set()
            for t in threads:
                t.join()
        finally:
            proc.terminate()
        out[variant] = {"idle": idle, "loaded": loaded, "texts_per_s": rate}
        print(f"  blocking, {variant:8s}: query p50 / p99 idle {idle['p50']:.2f} / {idle['p99']:.2f} ms, beside "
              f"{clients} text clients {loaded['p50']:.2f} / {loaded['p99']:.2f} ms; {rate:.0f} texts/s", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=600, help="requests per gateway in each measurement")
    p.add_argument("--out", default="perf/out/gateway_tokenize.json")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--grpc-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--repo", default="", help=argparse.SUPPRESS)
    p.add_argument("--stub", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args.port, args.grpc_url, args.repo, args.serve, args.stub)

    workdir = Path(tempfile.mkdtemp(prefix="pergola-tokenize-"))
    res: dict = {"model": "qwen3-tiny", "device": "cpu", "text_chars": len(TEXT), "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with pergola_stack(model_folder("qwen3-tiny", workdir), workdir, False, gateway=False) as (opts, _):
        grpc_url = f"127.0.0.1:{opts.grpc_port}"
        res["latency"] = latency(grpc_url, opts.repo, args.n)
        for v in VARIANTS:
            row = res["latency"][v]
            print(f"  latency, {v:8s}: p50 {row['p50']:.2f} ms, p99 {row['p99']:.2f} ms", flush=True)
        res["blocking"] = blocking(grpc_url, opts.repo, max(100, args.n // 2))
    write_result(res, args.out)


if __name__ == "__main__":
    main()
