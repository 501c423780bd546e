"""Memory stays flat: steady traffic of varying shapes for PERGOLA_SOAK_MINUTES (10) against
the test server (perf/soak.py); no process may grow by more than 100 MB after the warm-up."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import soak  # noqa: E402

MINUTES = float(os.environ.get("PERGOLA_SOAK_MINUTES", "10"))
MAX_GROWTH_MB = 100  # Triton's own L0_memory_growth bound


def test_memory_stays_flat_under_varying_traffic(server):
    result = soak.soak(server.grpc_url, server.repo, "embed", MINUTES, clients=4, every_s=15)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    assert result["ok"] > 0 and result["wrong"] == 0
    assert set(result["growth_mb"]) >= {"tritonserver", "minilm_encoder", "minilm_tokenizer"}
    for name, g in result["growth_mb"].items():
        assert g["growth"] <= MAX_GROWTH_MB, (name, g)
