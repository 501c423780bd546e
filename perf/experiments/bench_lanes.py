"""Experiment: can a batch-1 query run beside bulk steps in one process, on a high-priority CUDA stream?

Question for the scheduling design (engine/loop.py): the encode loop runs one step at a time, so a
query waits for the step in flight (and the one launched behind it). Bulk steps of 16k tokens take
~30 ms on the H200 and a 4,096-token sequence cannot be cut, so step granularity alone cannot hold a
query near its idle latency. This measures, in process on the Qwen3-0.6B shape:
  - `loop_B`: today's EncodeLoop with step budget B: query latency while bulk requests keep it busy;
  - `lanes_P`: bulk steps run by a thread on a normal stream, queries by another thread on a stream
    of priority P (high = -1 or the device's greatest, normal = 0), each with its own engine;
and bulk throughput alone and with the queries, for 100 x 512 and 25 x 4,096 bulk requests.
`--loop-variant LABEL:FIELD=VALUE,...` measures only the loop, once per EngineConfig variant
(e.g. the queries' own stream with an SM margin), the default engine first:

    python3 perf/experiments/bench_lanes.py --out perf/out/lanes.json
    python3 perf/experiments/bench_lanes.py --loop-variant stream16:query_stream=1,query_sm_margin=16
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from common import model_folder, parse_variants, percentiles, write_result  # noqa: E402

from pergola.config import EngineConfig  # noqa: E402
from pergola.engine import EncodeRequest, Engine  # noqa: E402
from pergola.engine.loop import EncodeLoop, Job  # noqa: E402

rng = np.random.default_rng(0)


def request(n: int, length: int) -> EncodeRequest:
    return EncodeRequest(rng.integers(100, 30000, n * length).astype(np.int64), np.full(n, length, np.int32))


def warm(engine: Engine, stream: torch.cuda.Stream, reqs: list[EncodeRequest]) -> None:
    with torch.cuda.stream(stream):
        for r in reqs:
            for _ in range(3):  # warm-up, capture, replay for every graph key the shape uses
                engine.encode([r])
    torch.cuda.synchronize()


class Bulk(threading.Thread):
    """Encodes `req` back to back on `stream` until stopped; counts texts."""

    def __init__(self, engine: Engine, stream: torch.cuda.Stream, req: EncodeRequest) -> None:
        super().__init__(daemon=True)
        self.engine, self.stream, self.req = engine, stream, req
        self.stop = threading.Event()
        self.texts = 0
        self.seconds = 0.0

    def run(self) -> None:
        torch.cuda.set_device(self.engine.device)
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.engine.encode([self.req])
                self.texts += self.req.lengths.size
        self.seconds = time.perf_counter() - t0


def queries(call, n: int, gap_s: float = 0.005) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(gap_s)
    return out


def lanes(bulk_engine: Engine, query_engine: Engine, bulk_req: EncodeRequest, query: EncodeRequest,
          priority: int, n: int, seconds: float) -> dict:
    sb = torch.cuda.Stream()
    sq = torch.cuda.Stream(priority=priority)
    warm(bulk_engine, sb, [bulk_req])
    warm(query_engine, sq, [query])
    alone = Bulk(bulk_engine, sb, bulk_req)
    alone.start()
    time.sleep(seconds)
    alone.stop.set()
    alone.join()
    bulk = Bulk(bulk_engine, sb, bulk_req)
    bulk.start()
    time.sleep(0.5)

    def one() -> None:
        with torch.cuda.stream(sq):
            query_engine.encode([query])

    ms = queries(one, n)
    bulk.stop.set()
    bulk.join()
    return {"query_ms": percentiles(ms), "bulk_alone_per_s": alone.texts / alone.seconds,
            "bulk_with_queries_per_s": bulk.texts / bulk.seconds}


class BulkFeed(threading.Thread):
    """Keeps `depth` bulk requests queued on an encode loop (the server's four bulk clients);
    counts the texts answered."""

    def __init__(self, loop: EncodeLoop, req: EncodeRequest, depth: int = 4) -> None:
        super().__init__(daemon=True)
        self.loop, self.req = loop, req
        self.slots = threading.Semaphore(depth)
        self.stop = threading.Event()
        self.texts = 0

    def done(self, result: np.ndarray) -> None:
        self.texts += result.shape[0]
        self.slots.release()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.slots.acquire(timeout=0.1):
                self.loop.submit(Job(self.req, deliver=self.done, fail=lambda e: self.slots.release()))


def query_caller(lp: EncodeLoop, query: EncodeRequest) -> Callable[[], float]:
    """-> a function that submits `query`, waits for its answer and returns the ms it took; called
    three times here (the query lane's graph key: warm-up, capture, replay)."""
    answered = threading.Event()

    def call() -> float:
        answered.clear()
        t0 = time.perf_counter()
        lp.submit(Job(query, deliver=lambda r: answered.set(), fail=lambda e: answered.set()))
        answered.wait()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        call()
    return call


def loop(engine: Engine, bulk_req: EncodeRequest, query: EncodeRequest, n: int, seconds: float) -> dict:
    """Today's single loop: bulk jobs kept 4 deep, queries submitted one at a time."""
    lp = EncodeLoop(engine)
    query_once = query_caller(lp, query)
    feed = BulkFeed(lp, bulk_req)
    t0 = time.perf_counter()
    feed.start()
    time.sleep(seconds)
    alone = feed.texts / (time.perf_counter() - t0)
    t1, c1 = time.perf_counter(), feed.texts
    ms = queries(query_once, n)
    with_q = (feed.texts - c1) / (time.perf_counter() - t1)
    feed.stop.set()
    time.sleep(0.5)
    lp.stop()
    return {"query_ms": percentiles(ms), "bulk_alone_per_s": alone, "bulk_with_queries_per_s": with_q}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="perf/out/lanes.json")
    p.add_argument("--workdir", default="/tmp/pergola-bench")
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--budgets", type=int, nargs="+", default=[16384, 4096])
    p.add_argument("--switch-interval", type=float, nargs="+", default=[0.005, 0.0005])
    p.add_argument("--loop-variant", nargs="*", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
                   help="measure only the loop, for the default engine and each of these")
    args = p.parse_args()
    folder = model_folder("qwen3-0.6b", Path(args.workdir))
    low, high = torch.cuda.Stream.priority_range()
    print(f"stream priorities: low {low}, high {high}", flush=True)
    cfg = dict(model_dir=str(folder), device="cuda:0", dtype="bfloat16")
    if args.loop_variant:
        write_result(loop_variants(cfg, parse_variants(args.loop_variant), args.n, args.seconds), args.out)
        return
    bulk_engine, query_engine = Engine(EngineConfig(**cfg)), Engine(EngineConfig(**cfg))
    query = request(1, 128)
    res: dict = {"priority_range": [low, high], "idle": {}, "runs": []}
    sq = torch.cuda.Stream(priority=high)
    warm(query_engine, sq, [query])

    def idle_one() -> None:
        with torch.cuda.stream(sq):
            query_engine.encode([query])

    res["idle"] = percentiles(queries(idle_one, args.n))
    print(f"idle query: {res['idle']}", flush=True)
    for n_texts, length in ((100, 512), (25, 4096)):
        bulk_req = request(n_texts, length)
        for interval in args.switch_interval:
            sys.setswitchinterval(interval)
            for label, prio in (("high", high), ("normal", 0)):
                r = lanes(bulk_engine, query_engine, bulk_req, query, prio, args.n, args.seconds)
                r |= {"mode": f"lanes_{label}", "bulk": f"{n_texts}x{length}", "switch_interval": interval}
                res["runs"].append(r)
                print(r, flush=True)
        sys.setswitchinterval(0.005)
        for budget in args.budgets:
            engine = Engine(EngineConfig(**cfg, max_batch_tokens=budget))
            warm(engine, torch.cuda.current_stream(), [bulk_req, query])
            r = loop(engine, bulk_req, query, args.n, args.seconds)
            r |= {"mode": f"loop_{budget}", "bulk": f"{n_texts}x{length}"}
            res["runs"].append(r)
            print(r, flush=True)
            del engine
            torch.cuda.empty_cache()
    write_result(res, args.out)


def loop_variants(cfg: dict, variants: dict[str, dict], n: int, seconds: float) -> dict:
    """loop() for the default engine and each variant, under 100 x 512 and 25 x 4,096 bulk requests."""
    query, runs = request(1, 128), []
    for label, overrides in {"default": {}, **variants}.items():
        engine = Engine(EngineConfig(**cfg, **overrides))
        for n_texts, length in ((100, 512), (25, 4096)):
            bulk_req = request(n_texts, length)
            warm(engine, torch.cuda.current_stream(), [bulk_req, query])
            r = loop(engine, bulk_req, query, n, seconds)
            r |= {"mode": f"loop_{label}", "options": overrides, "bulk": f"{n_texts}x{length}",
                  "bulk_kept": r["bulk_with_queries_per_s"] / r["bulk_alone_per_s"]}
            runs.append(r)
            print(r, flush=True)
        del engine
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_set_sm_carveout_experimental"):
            torch._C._set_sm_carveout_experimental(None)  # a green split's carveout is set for the process
    return {"runs": runs}


if __name__ == "__main__":
    main()
