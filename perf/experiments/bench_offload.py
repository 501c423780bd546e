"""Where the gateway's bulk CPU work should run: on its event loop, on a thread, or in a worker
process (gateway/offload.py chose by this).

    python perf/experiments/bench_offload.py --seconds 3 --out perf/out/offload.json

Jobs, each the gateway's own CPU work for one bulk request or answer:
  nothing        abs(-1): what a hand-off costs
  parse_64k      a body of 20 x 512 ids (~68 kB), about the gateway's PARSE_BYTES
  parse_ids      a 100 x 512 token-id /v1/embeddings body (~340 kB): orjson.loads, then the ids
                 as one int64 array (what NAME_encoder is sent)
  render_floats  a 100 x 1,024 float32 /v1/embeddings answer rendered as JSON (orjson, numpy rows)
  render_tokens  a /tokenize answer of 100,000 tokens (an object per token) rendered as JSON
Modes: `loop` (the job in the coroutine, as the gateway did), `thread` (run_in_executor on a
thread pool of 2), `process` (a pool of 2 spawned processes: raw bytes / numpy in, numpy / bytes
out; the job's time through it alone, hand-off included, is `alone_in_a_process_ms`). For each
mode, 4 coroutines submit jobs back to back (4 bulk clients) for --seconds while a ticker on the
same loop sleeps 1 ms at a time and records when it wakes: a request arriving at a
random moment waits until the next wake-up (loop_wait_ms, ~0.5 ms p50 / 1 ms max on a free loop).
Under uvloop, as uvicorn runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))
from common import percentiles, write_result  # noqa: E402


def body_ids(n: int = 100, length: int = 512) -> bytes:
    rng = np.random.default_rng(0)
    return orjson.dumps({"model": "bench", "input": rng.integers(0, 150_000, (n, length)).tolist()})


def parse_ids(raw: bytes) -> tuple[np.ndarray, np.ndarray]:
    data = orjson.loads(raw)["input"]
    lengths = np.fromiter(map(len, data), dtype=np.int32, count=len(data))
    flat = np.fromiter((i for row in data for i in row), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def render_floats(vectors: np.ndarray) -> bytes:
    return orjson.dumps({"object": "list", "model": "bench",
                         "data": [{"object": "embedding", "index": i, "embedding": row}
                                  for i, row in enumerate(vectors)],
                         "usage": {"prompt_tokens": 51_200, "total_tokens": 51_200}},
                        option=orjson.OPT_SERIALIZE_NUMPY)


def render_tokens(ids: np.ndarray) -> bytes:
    return orjson.dumps([[{"id": int(i), "text": "tok", "special": False, "start": 4 * k, "stop": 4 * k + 3}
                          for k, i in enumerate(ids.tolist())]])


JOBS: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "nothing": (abs, lambda: -1),  # the hand-off alone
    "parse_64k": (parse_ids, lambda: body_ids(20, 512)),  # a body at the gateway's PARSE_BYTES
    "parse_ids": (parse_ids, body_ids),
    "render_floats": (render_floats, lambda: np.random.default_rng(0).standard_normal((100, 1024), np.float32)),
    "render_tokens": (render_tokens, lambda: np.arange(100_000, dtype=np.int64)),
}


def arrival_waits(wakes: np.ndarray, samples: int = 20_000) -> dict:
    """What a request arriving at a uniformly random moment waits for the loop: the time to the
    ticker's next wake-up (1 ms apart when the loop is free), over `samples` moments."""
    at = np.random.default_rng(1).uniform(wakes[0], wakes[-1], samples)
    nxt = wakes[np.searchsorted(wakes, at)]
    return percentiles(list((nxt - at) * 1e3))


def one_by_one(pool: Executor, job: Callable[[Any], Any], payload: Any, n: int = 20) -> float:
    """p50 ms of `job` through `pool` with nothing else in flight: its hand-off included."""
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        pool.submit(job, payload).result()
        ms.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ms))


def warm(_: int) -> int:
    return os.getpid()


async def measure(job: Callable[[Any], Any], payload: Any, pool: Executor | None, seconds: float,
                  clients: int) -> dict:
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    wakes: list[float] = []
    latencies: list[float] = []

    async def ticker() -> None:
        while loop.time() < stop:
            wakes.append(time.perf_counter())
            await asyncio.sleep(0.001)

    async def client() -> None:
        while loop.time() < stop:
            t0 = time.perf_counter()
            if pool is None:
                job(payload)
            else:
                await loop.run_in_executor(pool, job, payload)
            latencies.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0)

    await asyncio.gather(ticker(), *(client() for _ in range(clients)))
    return {"loop_wait_ms": arrival_waits(np.asarray(wakes)), "job_ms": percentiles(latencies),
            "jobs_per_s": len(latencies) / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    p.add_argument("--out", default="perf/out/offload.json")
    args = p.parse_args()
    import multiprocessing as mp

    import uvloop

    res: dict = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "jobs": {}}
    threads = ThreadPoolExecutor(2)
    procs = ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"))
    list(procs.map(warm, range(4)))
    for name in args.jobs:
        job, make = JOBS[name]
        payload = make()
        t0 = time.perf_counter()
        for _ in range(5):
            job(payload)
        res["jobs"][name] = row = {"alone_ms": (time.perf_counter() - t0) / 5 * 1e3,
                                   "alone_in_a_process_ms": one_by_one(procs, job, payload)}
        for mode, pool in (("loop", None), ("thread", threads), ("process", procs)):
            row[mode] = uvloop.run(measure(job, payload, pool, args.seconds, args.clients))
            late, took = row[mode]["loop_wait_ms"], row[mode]["job_ms"]
            print(f"{name:14s} {mode:8s} loop wait p50 {late['p50']:6.2f} p99 {late['p99']:6.2f} max "
                  f"{late['max']:6.2f} ms; job p50 {took['p50']:6.2f} ms, {row[mode]['jobs_per_s']:6.1f}/s "
                  f"(alone {row['alone_ms']:.2f} ms, alone in a process {row['alone_in_a_process_ms']:.2f})",
                  flush=True)
    procs.shutdown()
    write_result(res, args.out)


if __name__ == "__main__":
    main()
