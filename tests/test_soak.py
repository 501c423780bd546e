"""Memory stays flat: steady traffic of varying shapes for PERGOLA_SOAK_MINUTES (10) against
the test server (perf/soak.py); no process may grow by more than 100 MB after the warm-up."""

from __future__ import annotations

import json
import os

import pytest
import soak

pytestmark = [pytest.mark.server, pytest.mark.soak]
MINUTES = float(os.environ.get("PERGOLA_SOAK_MINUTES", "10"))
MAX_GROWTH_MB = 100  # Triton's own L0_memory_growth bound


def test_memory_stays_flat_under_varying_traffic(server):
    result = soak.soak(server.grpc_url, server.repo, "embed", MINUTES, clients=4, every_s=15)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    assert result["ok"] > 0 and result["wrong"] == 0
    assert set(result["growth_mb"]) >= {"tritonserver", "minilm_encoder", "minilm_tokenizer"}
    for name, g in result["growth_mb"].items():
        assert g["growth"] <= MAX_GROWTH_MB, (name, g)


def _samples(rss: list[float]) -> list[dict]:
    return [{"t_s": i * 15.0, "rss_mb": {"encoder": v}} for i, v in enumerate(rss)] + \
        [{"t_s": len(rss) * 15.0, "rss_mb": {"encoder": rss[-1]}, "idle": True}]


def test_growth_counts_rising_peaks_not_swings():
    """A leak (every sample 30 MB above the last) is growth; RSS swinging with what is in flight
    (800 <-> 1,000 MB the whole run) is not."""
    leak = soak.growth(_samples([800 + 30 * i for i in range(10)]))["encoder"]
    assert leak["growth"] == 180 > MAX_GROWTH_MB
    swing = soak.growth(_samples([800, 1000] * 5))["encoder"]
    assert swing["growth"] == 0 and swing["peak"] == 1000
