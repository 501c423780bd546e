"""Start-up cost of the Triton attention kernel: first call (JIT compile) vs later calls, empty cache.

    TRITON_CACHE_DIR=$(mktemp -d) python3 perf/experiments/compile_cost.py
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from pergola.layers.fused import split_qkv  # noqa: E402
from pergola.layers.triton_attention import ragged_attention  # noqa: E402

dev = torch.device("cuda")
torch.zeros(1, device=dev)
for t in (128, 512, 128, 512):  # 16-row programs up to 128 tokens, 64-row above: two compiled variants
    q, k, v = split_qkv(torch.randn(t, 32 * 128, device=dev, dtype=torch.bfloat16), 16, 8, 128)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    t0 = time.perf_counter()
    ragged_attention(q, k, v, cu, True)
    torch.cuda.synchronize()
    print(f"{t} tokens: first-or-later call {time.perf_counter() - t0:.3f} s", flush=True)
