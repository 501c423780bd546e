"""Attention kernels on the short steps of online queries, as a graph step runs them.

    python perf/experiments/bench_short_attn.py [--shapes 1x128 1x512 8x128] [--out short_attn.json]

For each shape (sequences x tokens each, Qwen3-0.6B heads 16/8 x 128, causal, BF16) every
available backend and a few tile choices of the Triton kernel (pergola.layers.triton_attention)
run 28 calls on 28 distinct q/k/v buffers, strided views into a fused qkv tensor as in the
model, captured in one CUDA graph and replayed: µs per call, best of 5 replays. Each Triton
tile's output is first checked against PyTorch's FA2 on the same inputs (max |diff|).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from pergola.cudagraph import capture  # noqa: E402
from pergola.layers.attention import AttentionMetadata, make_backend  # noqa: E402
from pergola.layers.attention_probe import candidates  # noqa: E402
from pergola.layers.fused import split_qkv  # noqa: E402
from pergola.layers.triton_attention import ragged_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
# (BM, BN, warps, stages) of the Triton kernel
TILES = [(64, 64, 4, 3), (32, 64, 4, 3), (16, 64, 4, 3), (16, 32, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3)]


def layer_inputs(t: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """28 layers' q/k/v: views into a fused qkv tensor [T, (Hq + 2 Hkv) D] each, as in the model."""
    return [split_qkv(torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=torch.bfloat16),
                      HEADS, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]


def time_graph(run, reps: int = 5) -> float:
    """µs per attention call of `run` (LAYERS calls), replayed from a CUDA graph."""
    run()
    graph = torch.cuda.CUDAGraph()
    capture(graph, run)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / LAYERS)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["1x128", "1x256", "1x512", "8x128", "4x512", "1x1024", "1x2048"])
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    causal = bool(args.causal)
    results: dict[str, dict[str, float]] = {}
    backends = {name: make_backend(name, dev, torch.bfloat16) for name in candidates(HEAD_DIM, torch.bfloat16, probe_fa4=True)}
    for shape in args.shapes:
        seqs, length = map(int, shape.split("x"))
        t = seqs * length
        cu_host = torch.arange(0, t + 1, length, dtype=torch.int32)
        meta = AttentionMetadata(cu_seqlens=cu_host.to(dev), max_seqlen=length, causal=causal)
        layers = layer_inputs(t, dev)
        ref = make_backend("torch_flash", dev, torch.bfloat16)(*layers[0], meta)
        row: dict[str, float] = {}
        for name, attn in backends.items():
            meta.plan = attn.plan(cu_host, HEADS, KV_HEADS, HEAD_DIM, causal, graph_key=(seqs, t))
            row[name] = time_graph(lambda: [attn(q, k, v, meta) for q, k, v in layers])  # noqa: B023
        for bm, bn, warps, stages in TILES:
            def call(q, k, v):  # noqa: ANN001, ANN202
                return ragged_attention(q, k, v, meta.cu_seqlens, causal, bm, bn, warps, stages)  # noqa: B023
            name = f"triton {bm}x{bn}/w{warps}s{stages}"
            row[name + " maxdiff"] = (call(*layers[0]).float() - ref.float()).abs().max().item()
            row[name] = time_graph(lambda: [call(q, k, v) for q, k, v in layers])  # noqa: B023
        results[shape] = row
        print(shape, "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
