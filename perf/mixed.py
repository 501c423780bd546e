"""The mixed-traffic suite's driver, for any server: sequential batch-1 queries while client
processes keep the server saturated with bulk requests (perf/bench_mixed.py runs it against
pergola, perf/bench_vllm.py --suites mixed against vLLM's server, with the same inputs).

Per bulk load, one timeline (seconds from its start):
  idle     queries of the first kind alone (`idle_s`): the idle latency at the same moment
  loaded   the bulk processes start; after `warm_s`, every query kind in turn, `n` each
  alone    queries pause for `alone_s`: bulk throughput without queries
  after    the bulk processes stop; queries of the first kind again (`idle_s`)
Bulk throughput comes from each bulk request's completion time, counted inside the `loaded`
window (after its warm-up) and inside the `alone` window, so both figures come from one run of
the same processes. Every query's (time, latency, kind) is kept for the plot.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from common import percentiles

# kind -> factory run in the measuring thread, returning the call that sends one query
QueryKinds = dict[str, Callable[[], Callable[[], Any]]]
# name -> (pre-tokenized "ids" or "text", tokens per input, inputs per request), per bulk process
LOADS = {"ids_100x512": ("ids", 512, 100), "ids_25x4096": ("ids", 4096, 25), "text_100x512": ("text", 512, 100)}
QUERY = "how do I read a file line by line in python"  # the short text query (~8 words)
# The query client's pause between two queries: with ~4 ms per query on the H200 it sends ~150 a
# second (perf/results/2026-12-05-9da2d89/mixed.json); --query-gap-ms sweeps the rate.
QUERY_GAP_S = 0.002


def _bulk_worker(make_sender: Callable, endpoint: tuple, batches: list, started: Any, stop: Any, q: Any) -> None:
    send = make_sender(*endpoint)
    send(batches[0][:2])  # connection and import warm-up, before the common start
    started.wait()
    done: list[tuple[float, int]] = []
    i = 0
    while not stop.is_set():
        batch = batches[i % len(batches)]
        send(batch)
        done.append((time.time(), len(batch)))
        i += 1
    q.put(done)


def _collect(q: Any, procs: list, timeout_s: float = 600) -> list:
    """Each bulk process's rows; a process that died (its sender raised) ends the run with its exit code."""
    out, end = [], time.time() + timeout_s
    while len(out) < len(procs):
        try:
            out.append(q.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.time() > end:
                raise RuntimeError(f"bulk processes failed (exit codes {dead}) or timed out: see their tracebacks above")
    return out


def _queries(kind: str, call: Callable[[], Any], *, n: int | None = None, seconds: float | None = None,
             gap_s: float = QUERY_GAP_S) -> list[tuple[float, float, str]]:
    """(wall time, latency ms, kind) of sequential queries: `n` of them, or for `seconds`."""
    out, end = [], time.time() + (seconds or 0)
    while (n is not None and len(out) < n) or (seconds is not None and time.time() < end):
        t0 = time.perf_counter()
        call()
        out.append((time.time(), (time.perf_counter() - t0) * 1e3, kind))
        time.sleep(gap_s)
    return out


def _rate(done: list[tuple[float, int]], start: float, end: float) -> float:
    texts = sum(n for t, n in done if start <= t < end)
    return texts / (end - start) if end > start else 0.0


def run_load(kinds: QueryKinds, make_sender: Callable, endpoint: tuple, bulk_batches: list[list],
             *, n: int = 150, idle_s: float = 2.0, warm_s: float = 1.5, alone_s: float = 5.0,
             gap_s: float = QUERY_GAP_S, loaded_s: float | None = None, log: Callable[[str], None] = print) -> dict:
    """One bulk load: `bulk_batches[p]` are process p's requests (sent in a loop); the query
    client sleeps `gap_s` between its queries (the query rate sets what the bulk work loses).
    `loaded_s`: each kind's loaded queries go on for at least that long (bulk requests that take
    seconds each), past `n` if need be."""
    calls = {kind: factory() for kind, factory in kinds.items()}
    first = next(iter(calls))
    for call in calls.values():  # warm every path (graph capture, connections) before timing
        for _ in range(5):
            call()
    ctx = mp.get_context("spawn")
    q, started, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_bulk_worker, args=(make_sender, endpoint, batches, started, stop, q))
             for batches in bulk_batches]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let the processes import and connect (they wait for `started`)
    t0 = time.time()
    points = _queries(first, calls[first], seconds=idle_s)
    idle = {first: percentiles([ms for _, ms, _ in points])}
    started.set()
    t_bulk = time.time()
    time.sleep(warm_s)
    t_loaded = time.time()
    for kind, call in calls.items():
        points += _queries(kind, call, n=n, seconds=loaded_s, gap_s=gap_s)
    t_alone = time.time()
    time.sleep(alone_s)
    t_stop = time.time()
    stop.set()
    done = [row for rows in _collect(q, procs) for row in rows]
    for p in procs:
        p.join(timeout=30)
    t_idle = time.time()
    points += _queries(first, calls[first], seconds=idle_s)
    loaded = {kind: percentiles([ms for t, ms, k in points if k == kind and t_loaded <= t < t_alone])
              for kind in calls}
    res = {
        "idle": idle,
        "after": {first: percentiles([ms for t, ms, _ in points if t >= t_idle])},
        "loaded": loaded,
        "bulk_per_s_with_queries": _rate(done, t_loaded, t_alone),
        "bulk_per_s_alone": _rate(done, t_alone, t_stop),
        "bulk_processes": len(procs),
        "query_gap_ms": gap_s * 1e3,
        "queries_per_s": len(calls) * n / (t_alone - t_loaded),
        "timeline": {"t0": t0, "bulk_start": t_bulk - t0, "bulk_stop": t_stop - t0,
                     "points": [(round(t - t0, 4), round(ms, 3), k) for t, ms, k in points]},
    }
    res["bulk_kept"] = res["bulk_per_s_with_queries"] / res["bulk_per_s_alone"] if res["bulk_per_s_alone"] else None
    # The rates count bulk requests finished inside each window: a window that few finish in says little.
    res["bulk_requests_with_queries"] = sum(1 for t, _ in done if t_loaded <= t < t_alone)
    if res["bulk_requests_with_queries"] < 2 * len(procs):
        log(f"  (only {res['bulk_requests_with_queries']} bulk requests finished while the queries ran: "
            "the bulk figures of this load are coarse; raise -n)")
    for kind, row in loaded.items():
        log(f"  {kind:14s} loaded p50 {row['p50']:7.2f} p99 {row['p99']:7.2f} ms")
    log(f"  idle {first}: p50 {idle[first]['p50']:.2f} p99 {idle[first]['p99']:.2f} ms; bulk "
        f"{res['bulk_per_s_alone']:.0f}/s alone, {res['bulk_per_s_with_queries']:.0f}/s with queries "
        f"({(res['bulk_kept'] or 0) * 100:.1f}%) beside {res['queries_per_s']:.0f} queries/s")
    return res


def idle_latency(kinds: QueryKinds, n: int) -> dict:
    """Every query kind on the idle server, `n` each, after a warm-up."""
    out = {}
    for kind, factory in kinds.items():
        call = factory()
        for _ in range(5):
            call()
        out[kind] = percentiles([ms for _, ms, _ in _queries(kind, call, n=n)])
    return out


def verdict(idle: dict, loaded: dict, kept: float | None) -> dict:
    """The goal per kind: loaded p99 <= 3x idle p99 and p50 <= 2x idle p50; bulk kept >= 95%."""
    out = {kind: {"p50_ratio": loaded[kind]["p50"] / idle[kind]["p50"],
                  "p99_ratio": loaded[kind]["p99"] / idle[kind]["p99"]} for kind in loaded if kind in idle}
    for row in out.values():
        row["met"] = row["p50_ratio"] <= 2.0 and row["p99_ratio"] <= 3.0
    return {"kinds": out, "bulk_kept_met": kept is not None and kept >= 0.95}


def token_batches(windows: Any, length: int, count: int, procs: int) -> list[list[np.ndarray]]:
    """Each process's bulk requests, pre-tokenized (seeds as bench_server's throughput suite)."""
    return [[windows.ids(length, count, seed=10_000 * p + i) for i in range(3)] for p in range(procs)]


def text_batches(windows: Any, length: int, count: int, procs: int) -> list[list[str]]:
    return [[windows.texts(length, count, seed=20_000 * p + i) for i in range(3)] for p in range(procs)]


def bulk_batches(windows: Any, load: str, procs: int) -> tuple[str, list[list]]:
    """-> ("ids" | "text", each process's requests) for a LOADS entry."""
    how, length, count = LOADS[load]
    return how, (token_batches if how == "ids" else text_batches)(windows, length, count, procs)
