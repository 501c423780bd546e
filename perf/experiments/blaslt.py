"""cuBLASLt vs cuBLAS for Qwen3-0.6B's four projections at batch-1 sizes, inside a CUDA graph.

    python perf/experiments/blaslt.py

M = 128 and 512 tokens; qkv, o, gate_up, down over 28 distinct weights, plain (F.linear) and with
the residual added in place (addmm_ with beta = 1, as the o/down projections run): µs per call
with torch's preferred BLAS library set to each in turn (bench_gemm.graph_time_us).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_gemm import graph_time_us  # noqa: E402

torch.manual_seed(0)
for M in (128, 512):
    for name, n, k in (("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)):
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(28)]
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(M, n, device="cuda", dtype=torch.bfloat16)
        res = []
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            res.append(graph_time_us(lambda i: F.linear(x, ws[i]), 28))  # noqa: B023
            res.append(graph_time_us(lambda i: r.addmm_(x, ws[i].t()), 28))  # noqa: B023
        print(f"M={M} {name}: cublas {res[0]:.2f} (addmm_ {res[1]:.2f})  "
              f"cublaslt {res[2]:.2f} (addmm_ {res[3]:.2f}) µs", flush=True)
torch.backends.cuda.preferred_blas_library("cublas")
