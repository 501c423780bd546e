"""perf/bench_scaling.py's arithmetic (CPU): efficiency is emb/s at N over N times emb/s at N = 1,
per length, only where N = 1 measured that length."""

from __future__ import annotations

import pytest
from bench_scaling import efficiency


def point(emb_per_s: dict[str, float]) -> dict:
    """bench_scaling.measure's shape: length -> the throughput row."""
    return {"lengths": {length: {"embeddings_per_s": v} for length, v in emb_per_s.items()},
            "encoder_requests_per_server": []}


def test_efficiency_against_n_times_one_gpu():
    points = {"1": point({"512": 1000.0, "4096": 100.0}), "2": point({"512": 1900.0, "4096": 200.0}),
              "4": point({"512": 3000.0, "1024": 900.0})}
    eff = efficiency(points)
    assert set(eff) == {"2", "4"}
    assert eff["2"] == pytest.approx({"512": 0.95, "4096": 1.0})
    assert eff["4"] == pytest.approx({"512": 0.75})  # 1,024 has no N = 1 figure to compare with


def test_no_single_gpu_point_no_efficiency():
    assert efficiency({"2": point({"512": 1.0})}) == {"2": {}}
