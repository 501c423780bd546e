"""perf/experiments/trace_mixed.py's arithmetic (CPU): the device's busy time counts two streams'
overlapping kernels once, kernel time counts each; a query's cost to the bulk work splits into
kernel time added and idle time added per query."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf" / "experiments"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
from trace_mixed import device_timeline, split  # noqa: E402


def kernel(ts: float, dur: float, stream: int = 7) -> dict:
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_overlapping_streams_are_busy_once_and_counted_per_stream():
    # stream 7: 0-10 and 30-40; stream 13 (queries): 5-15, overlapping the first
    t = device_timeline([kernel(0, 10), kernel(30, 10), kernel(5, 10, stream=13)])
    assert t["window_us"] == 40 and t["busy_us"] == 25 and t["idle_us"] == 15
    assert t["kernel_us"] == 30 and t["kernel_us_by_stream"] == {"7": 20.0, "13": 10.0}
    assert device_timeline([]) == {"events": 0}


def test_a_query_cost_splits_into_kernel_and_idle_time():
    second = 1e6  # µs
    alone = {"wall_s": 1.0, "texts": 1000, "queries": 0, "window_us": second, "kernel_us": 0.95 * second,
             "idle_us": 0.05 * second, "busy_us": 0.95 * second}
    # 100 queries in a second: the bulk kept 80%; kernels +10% of the timeline, idle +10%
    mixed = {"wall_s": 1.0, "texts": 800, "queries": 100, "window_us": second, "kernel_us": 0.85 * second + 0.2 * second,
             "idle_us": 0.15 * second, "busy_us": 0.85 * second}
    per = split(alone, mixed)
    assert per["queries_per_s"] == 100 and per["bulk_kept"] == pytest.approx(0.8)
    assert per["bulk_lost_us"] == pytest.approx(2000)  # 20% of a second over 100 queries
    assert per["kernel_added_us"] == pytest.approx(1000) and per["idle_added_us"] == pytest.approx(1000)
    assert split(alone, {**mixed, "queries": 0}) == {}
