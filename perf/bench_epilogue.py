"""Bias + GELU in cuBLASLt's epilogue (Linear.activated) against matmul + GELU kernel, on the GPU:
time per call, distance from the exact (erf) GELU in fp32, and the same output replayed in a CUDA graph.

    python perf/bench_epilogue.py --out perf/results/DATE-COMMIT/epilogue.json

Shapes: the BERT-family intermediate projections of bge-m3 (K 1,024 -> N 4,096) and all-MiniLM-L6-v2
(384 -> 1,536), at a batch-1 query (128 tokens), 100 x 512 and 20 x 4,096 tokens.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from pergola.layers.linear import Linear

SHAPES = {"bge-m3": (1024, 4096), "minilm": (384, 1536)}
TOKENS = (128, 51_200, 81_920)


def timed_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def one(name: str, k: int, n: int, m: int) -> dict:
    torch.manual_seed(0)
    dense = Linear(k, n, bias=True)
    torch.nn.init.normal_(dense.weight, std=k ** -0.5)
    torch.nn.init.normal_(dense.bias, std=0.5)
    dense = dense.to("cuda", torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    exact = F.gelu(F.linear(x.float(), dense.weight.float(), dense.bias.float()))
    fused = dense.activated(x, "gelu")
    two = F.gelu(dense(x))
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(graph):
        static_y = dense.activated(static_x, "gelu")
    graph.replay()
    torch.cuda.synchronize()
    cos = F.cosine_similarity(fused.float(), exact, dim=1).min().item()
    return {"model": name, "m": m, "k": k, "n": n,
            "two_kernels_ms": timed_ms(lambda: F.gelu(dense(x))),
            "epilogue_ms": timed_ms(lambda: dense.activated(x, "gelu")),
            "max_abs_vs_exact": {"epilogue": (fused.float() - exact).abs().max().item(),
                                 "two_kernels": (two.float() - exact).abs().max().item()},
            "min_row_cosine_vs_exact": cos,
            "graph_replay_equals_eager": bool(torch.equal(static_y, fused))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [one(name, k, n, m) for name, (k, n) in SHAPES.items() for m in TOKENS]
    for r in rows:
        print(f"{r['model']:7} M={r['m']:6}: two kernels {r['two_kernels_ms']:.3f} ms, epilogue "
              f"{r['epilogue_ms']:.3f} ms ({r['two_kernels_ms'] / r['epilogue_ms']:.2f}x); max |diff| vs exact "
              f"{r['max_abs_vs_exact']['epilogue']:.2e} (two kernels {r['max_abs_vs_exact']['two_kernels']:.2e}); "
              f"min cosine {r['min_row_cosine_vs_exact']:.6f}; graph == eager: {r['graph_replay_equals_eager']}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
