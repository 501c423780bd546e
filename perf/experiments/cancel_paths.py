"""Which ways of giving up on a Triton call stop the encoder from computing it.

Triton propagates cancellation from gRPC clients only (its docs: request_cancellation), and checks it
"between ensemble steps"; the encoder drops queued jobs whose `sender.is_cancelled()` (engine/loop.py
`_expire`). This measures, on a CPU server, the tokens the encoder computes for a request given up
0.5 s after it was sent, while a request of known size (pre-tokenized, `BLOCK` tokens) keeps the
encoder busy, so that the given-up one is still queued:

    gRPC, straight to NAME_encoder (ids)           cancelled aio call
    gRPC, through the embed ensemble (texts)       cancelled aio call
    HTTP, straight to NAME_encoder (ids)           connection closed
    HTTP, through the embed ensemble (texts)       connection closed

    PYTHONPATH=python_models:client python perf/experiments/cancel_paths.py [--out FILE]

Tokens computed for the given-up request = the counter's rise less BLOCK (its 0 means the
cancellation reached the encoder before any of its work started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_overload import prose  # noqa: E402

BLOCK = 8192  # tokens of the request that keeps the encoder busy (32 x 256)


def tokens_total(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(r'^pergola_tokens_total\{model="mini_encoder"\} (\S+)', text, re.M)
    return float(found.group(1)) if found else 0.0


async def settled(metrics_port: int, quiet_s: float = 3.0) -> float:
    """The token counter once it has not moved for `quiet_s` (the encoder idle, its counters flushed)."""
    value, since = tokens_total(metrics_port), time.monotonic()
    while time.monotonic() - since < quiet_s:
        await asyncio.sleep(0.5)
        now = tokens_total(metrics_port)
        if now != value:
            value, since = now, time.monotonic()
    return value


def ids_request(n: int = 32, length: int = 256, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.concatenate([[101], rng.integers(1000, 29000, length - 2), [102]])
                          for _ in range(n)])
    return ids[None].astype(np.int64), np.full((1, n), length, np.int32)


async def one_case(opts, door: str, path: str) -> dict:
    import tritonclient.grpc.aio as grpcaio
    from tritonclient.grpc import InferInput

    from pergola.gateway.triton_http import Tensor, TritonHTTP

    grpc = grpcaio.InferenceServerClient(f"127.0.0.1:{opts.grpc_port}")
    http = TritonHTTP(f"127.0.0.1:{opts.http_port}")
    ids, lengths = ids_request()

    def grpc_inputs(model: str):
        if model == "embed":
            texts = np.array([t.encode() for t in prose(32, 200, seed=1)], dtype=object)
            x = InferInput("TEXT", [len(texts)], "BYTES")
            x.set_data_from_numpy(texts)
            return [x]
        a, b = InferInput("INPUT_IDS", list(ids.shape), "INT64"), InferInput("LENGTHS", list(lengths.shape), "INT32")
        a.set_data_from_numpy(ids)
        b.set_data_from_numpy(lengths)
        return [a, b]

    def http_inputs(model: str):
        if model == "embed":
            texts = np.array([t.encode() for t in prose(32, 200, seed=1)], dtype=object)
            return [Tensor("TEXT", texts, "BYTES")]
        return [Tensor("INPUT_IDS", ids, "INT64"), Tensor("LENGTHS", lengths, "INT32")]

    before = await settled(opts.metrics_port)  # earlier cases' work done and counted
    block = asyncio.create_task(grpc.infer("mini_encoder", grpc_inputs("mini_encoder")))
    await asyncio.sleep(0.2)
    model = "embed" if path == "ensemble" else "mini_encoder"
    if door == "grpc":
        call = asyncio.create_task(grpc.infer(model, grpc_inputs(model)))
    else:
        call = asyncio.create_task(http.infer(model, http_inputs(model), ["EMBEDDING"]))
    await asyncio.sleep(0.5)
    call.cancel()
    await block
    computed = await settled(opts.metrics_port) - before - BLOCK  # anything still running for it ends
    await http.close()
    await grpc.close()
    return {"door": door, "path": path, "tokens_computed_after_giving_up": computed}


def main() -> None:
    from pergola.cli import default_model_folder
    from pergola.repo_builder import build_repository, entry_from_folder
    from pergola.server import ServerOptions, free_port, start, wait_ready

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cancel-paths-"))
    entry = entry_from_folder(default_model_folder(), "mini", max_queue_seconds=60, cpu_threads=1)
    repo = build_repository(root / "repo", [entry], gpu=False)
    opts = ServerOptions(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    proc = start(opts, log_path=root / "server.log")
    results = []
    try:
        wait_ready(opts.http_port, proc, timeout=240, metrics_port=opts.metrics_port)
        for door in ("grpc", "http"):
            for path in ("encoder", "ensemble"):
                results.append(asyncio.run(one_case(opts, door, path)))
                print(results[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
