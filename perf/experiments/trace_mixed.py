"""Experiment: where a query's cost to the bulk work goes, on the GPU's timeline.

Each batch-1 query answered beside bulk work costs the bulk ~2 ms of an H100's time (perf/RESULTS.md,
History 2026-12-05 e2aaa64), about 1.5x the query's own forward. This runs the encode loop in process
(Qwen3-0.6B shape, 100 x 512-token bulk requests kept 4 deep, as the server's four bulk clients) and
records the device's kernels with torch.profiler (CUDA activity only: start and end of each kernel
and copy on the GPU) over a window without queries and one with sequential batch-1 queries of 128
tokens, `--gap-ms` apart. Per query it then splits what the bulk lost:
  - kernel time added: the query's own kernels, and bulk kernels slowed beside them;
  - idle time added: gaps in the device's timeline (the host behind: waiting for a query's step,
    answering it, launching the next bulk layer late);
and, with `--option query_stream=1`, the kernel time on each stream. `--option FIELD=VALUE` sets
EngineConfig fields, to compare designs (query_stream, query_sm_margin, query_tokens=0).

    python3 perf/experiments/trace_mixed.py --out perf/out/trace_mixed.json
    python3 perf/experiments/trace_mixed.py --option query_stream=1 --option query_sm_margin=16 \
        --out perf/out/trace_mixed_margin16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from anatomy import device_events, union_us  # noqa: E402
from bench_lanes import BulkFeed, query_caller, request  # noqa: E402
from common import model_folder, parse_variants, percentiles, write_result  # noqa: E402

from pergola.config import EngineConfig  # noqa: E402
from pergola.engine import Engine  # noqa: E402
from pergola.engine.loop import EncodeLoop  # noqa: E402


def device_timeline(events: list[dict]) -> dict:
    """Busy / idle time (µs) of the device over the events' span, and kernel time per stream
    (kernels of two streams may overlap: busy counts their union, kernel time each one)."""
    if not events:
        return {"events": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    busy = union_us(spans)
    per_stream: dict[str, float] = {}
    for e in events:
        stream = str(e.get("args", {}).get("stream", "?"))
        per_stream[stream] = per_stream.get(stream, 0.0) + float(e["dur"])
    return {"events": len(events), "window_us": window, "busy_us": busy, "idle_us": window - busy,
            "kernel_us": sum(per_stream.values()), "kernel_us_by_stream": per_stream}


def profiled_window(seconds: float, work) -> dict:
    """Run work(seconds) under torch.profiler's CUDA activity; -> its device timeline."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        extra = work(seconds)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
    return {"wall_s": wall, **extra, **device_timeline(device_events(prof))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--option", action="append", default=[], metavar="FIELD=VALUE", help="EngineConfig field")
    p.add_argument("--seconds", type=float, default=1.5, help="each profiled window")
    p.add_argument("--gap-ms", type=float, default=2.0, help="pause between two queries")
    p.add_argument("--workdir", default="/tmp/pergola-bench")
    p.add_argument("--out", default="perf/out/trace_mixed.json")
    args = p.parse_args()
    options = parse_variants(["x:" + ",".join(args.option)])["x"]
    folder = model_folder("qwen3-0.6b", Path(args.workdir))
    engine = Engine(EngineConfig(model_dir=str(folder), device="cuda:0", dtype="bfloat16", **options))
    bulk_req, query = request(100, 512), request(1, 128)
    loop = EncodeLoop(engine)
    query_once = query_caller(loop, query)
    feed = BulkFeed(loop, bulk_req)
    feed.start()
    time.sleep(3.0)  # the bulk shapes' first steps, and a steady pipeline

    def bulk_only(seconds: float) -> dict:
        c0 = feed.texts
        time.sleep(seconds)
        return {"texts": feed.texts - c0, "queries": 0}

    def with_queries(seconds: float) -> dict:
        c0, ms, stop = feed.texts, [], time.perf_counter() + seconds
        while time.perf_counter() < stop:
            ms.append(query_once())
            time.sleep(args.gap_ms / 1e3)
        return {"texts": feed.texts - c0, "queries": len(ms), "query_ms": percentiles(ms)}

    res: dict = {"options": options, "gpu": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "bulk_only": profiled_window(args.seconds, bulk_only),
                 "with_queries": profiled_window(args.seconds, with_queries)}
    feed.stop.set()
    time.sleep(0.5)
    loop.stop()
    res["per_query"] = split(res["bulk_only"], res["with_queries"])
    print(json.dumps(res["per_query"], indent=1), flush=True)
    write_result(res, args.out)


def split(alone: dict, mixed: dict) -> dict:
    """Per query, in µs: bulk time lost, kernel time added, idle time added (per second of each window)."""
    queries_per_s = mixed["queries"] / mixed["wall_s"]
    if not queries_per_s or "busy_us" not in alone or "busy_us" not in mixed:
        return {}
    rate_alone, rate_mixed = alone["texts"] / alone["wall_s"], mixed["texts"] / mixed["wall_s"]

    def per_s(w: dict, key: str) -> float:
        return w[key] / w["window_us"]  # µs of it per µs of timeline

    return {"queries_per_s": queries_per_s, "bulk_kept": rate_mixed / rate_alone,
            "bulk_lost_us": (1 - rate_mixed / rate_alone) / queries_per_s * 1e6,
            "kernel_added_us": (per_s(mixed, "kernel_us") - per_s(alone, "kernel_us")) / queries_per_s * 1e6,
            "idle_added_us": (per_s(mixed, "idle_us") - per_s(alone, "idle_us")) / queries_per_s * 1e6,
            "busy_alone": per_s(alone, "busy_us"), "busy_mixed": per_s(mixed, "busy_us")}


if __name__ == "__main__":
    main()
