"""Does the attention kernel care whether q, k, v are contiguous or views into the fused qkv buffer?

    python perf/experiments/bench_attn_layout.py

In the model, q/k/v are strided views of the qkv projection's output [T, (16 + 2 * 8) * 128] (no
copy); the start-up probe times contiguous tensors. This times each kernel both ways on the
Qwen3-0.6B heads, eagerly, 28 calls on 28 distinct buffers per run (as the 28 layers of a step
run), so L2 holds none of the inputs: µs per call and TFLOP/s (causal: half the score matrix).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from pergola.layers.attention import AttentionMetadata, make_backend  # noqa: E402
from pergola.layers.attention_probe import candidates  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28


def inputs(t: int, strided: bool, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if strided:
        qkv = torch.randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=torch.bfloat16)
        q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
        return (qkv[:, :q_end].view(t, HEADS, HEAD_DIM), qkv[:, q_end:k_end].view(t, KV_HEADS, HEAD_DIM),
                qkv[:, k_end:].view(t, KV_HEADS, HEAD_DIM))
    return (torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16),
            torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16),
            torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["4x4096", "32x512"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    results: dict[str, dict[str, float]] = {}
    for name in candidates(HEAD_DIM, torch.bfloat16, probe_fa4=True):
        attn = make_backend(name, dev, torch.bfloat16)
        for shape in args.shapes:
            seqs, length = map(int, shape.split("x"))
            t = seqs * length
            cu_host = torch.arange(0, t + 1, length, dtype=torch.int32)
            meta = AttentionMetadata(cu_seqlens=cu_host.to(dev), max_seqlen=length, causal=True,
                                     plan=attn.plan(cu_host, HEADS, KV_HEADS, HEAD_DIM, True))
            flops = 4 * seqs * length * length * HEADS * HEAD_DIM / 2
            for strided in (False, True):
                layers = [inputs(t, strided, dev) for _ in range(LAYERS)]
                for q, k, v in layers[:2]:
                    attn(q, k, v, meta)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                best = float("inf")
                for _ in range(5):
                    start.record()
                    for q, k, v in layers:
                        attn(q, k, v, meta)
                    end.record()
                    end.synchronize()
                    best = min(best, start.elapsed_time(end) * 1000 / LAYERS)
                key = f"{name} {shape} {'qkv views' if strided else 'contiguous'}"
                results[key] = {"us": best, "tflops": flops / best / 1e6}
                print(f"{key}: {best:.1f} µs per call, {flops / best / 1e6:.0f} TFLOP/s", flush=True)
                del layers
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
