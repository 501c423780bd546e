"""Sliding-window attention kernels on the GPU: PyTorch's FlashAttention-2 windowed varlen kernel
against pergola's Triton ragged kernel with its band (several block shapes), per layer call.

    python perf/bench_window.py --out perf/out/window.json

Shapes are ModernBERT's sliding layers (12 heads of 64, keys with |q - k| < 65) and
EmbeddingGemma's (3 query heads, 1 key/value head of 256, |q - k| < 257), bidirectional, at the
bulk steps a server runs (100 x 512, 20 x 4,096 tokens) and one long text. Each kernel's output is
checked against FlashAttention-2's (max |diff|) before it is timed; µs per call by CUDA events
over 20 calls after 3 warm-up calls. perf/README.md says which kernel BandAttention takes and why.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import cuda_time_us
from pergola.layers.attention import AttentionMetadata, TorchFlashAttention
from pergola.layers.fused import split_qkv
from pergola.layers.triton_attention import ragged_attention

MODELS = {  # name: (query heads, key/value heads, head dim, window)
    "modernbert": (12, 12, 64, 65),
    "embeddinggemma": (3, 1, 256, 257),
}
SHAPES = [(100, 512), (20, 4096), (1, 8192)]
# (block_m, block_n, num_warps, num_stages) of the Triton kernel
TRITON_CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (64, 32, 4, 2), (128, 128, 8, 2)]


def bench(model: str, seqs: int, length: int) -> dict:
    heads, kv, dim, window = MODELS[model]
    t = seqs * length
    qkv = torch.randn(t, (heads + 2 * kv) * dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = split_qkv(qkv, heads, kv, dim)  # views, as the models hand them over
    meta = AttentionMetadata.build([length] * seqs, q.device, causal=False, padded=False)
    ref = TorchFlashAttention.windowed(q, k, v, meta, window)
    row = {"flash_fa2": cuda_time_us(lambda: TorchFlashAttention.windowed(q, k, v, meta, window))}
    diffs = {}
    for bm, bn, warps, stages in TRITON_CONFIGS:
        name = f"triton_{bm}x{bn}_w{warps}_s{stages}"

        def call(bm=bm, bn=bn, warps=warps, stages=stages):
            return ragged_attention(q, k, v, meta.cu_seqlens, False, block_m=bm, block_n=bn, num_warps=warps,
                                    num_stages=stages, window=window)

        try:
            diffs[name] = (call().float() - ref.float()).abs().max().item()
            row[name] = cuda_time_us(call)
        except Exception as e:  # noqa: BLE001 - a block shape this GPU cannot run (shared memory)
            row[name] = None
            diffs[name] = f"{type(e).__name__}: {str(e)[:120]}"
    return {"us": row, "max_abs_diff_vs_fa2": diffs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="perf/out/window.json")
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    for model in MODELS:
        for seqs, length in SHAPES:
            key = f"{model} {seqs}x{length}"
            r = results["shapes"][key] = bench(model, seqs, length)
            best = min((n for n, us in r["us"].items() if us), key=lambda n: r["us"][n])
            print(f"{key}: " + ", ".join(f"{n} {us:.0f}" if us else f"{n} failed" for n, us in r["us"].items())
                  + f" µs -> {best}; max |diff| vs FA2 "
                  + ", ".join(f"{d:.3g}" if isinstance(d, float) else d for d in r["max_abs_diff_vs_fa2"].values()),
                  flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
