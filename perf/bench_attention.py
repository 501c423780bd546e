"""Full (non-windowed) attention kernels on the GPU, per layer call: the registered ragged backends the
start-up probe chooses from, against cuDNN's fused attention through PyTorch's SDPA.

    python perf/bench_attention.py --out perf/out/attention.json

cuDNN runs two ways: on [B, H, L, D] views of the same q/k/v (no copy; batches of one length only), and
through PyTorch's ragged entry (nested tensors' `_cudnn_attention_forward` with cumulative lengths, on
contiguous copies), whose time includes what it does on the host each call. This asks whether cuDNN is
worth a ragged backend; neither is a path the engine takes. Head layouts are the shapes the servers are
measured on (bge-m3 and ModernBERT: 16 / 12 heads of 64, bidirectional; Qwen3-0.6B: 16 query and 8
key/value heads of 128, causal), at the bulk steps the engine runs (4 x 4,096 and 32 x 512 tokens) and
one long text. Each output is checked against PyTorch's FlashAttention-2 (max |diff|); µs by CUDA events
over 20 eager calls after 3 warm-up calls on the same q/k/v for every kernel (planning outside the timing,
as the probe times large steps), and TFLOP/s of the attention's two matmuls (half for causal). An H200's answer:
perf/results/2026-12-07-e7b1fc6/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from common import cuda_time_us
from pergola.layers.attention import AttentionMetadata, make_backend
from pergola.layers.attention_probe import candidates
from pergola.layers.fused import split_qkv
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYOUTS = {  # name: (query heads, key/value heads, head dim, causal)
    "bge-m3": (16, 16, 64, False),
    "gte-modernbert": (12, 12, 64, False),
    "qwen3-0.6b": (16, 8, 128, True),
}
SHAPES = [(4, 4096), (32, 512), (1, 4096)]


def cudnn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: int, causal: bool):
    """SDPA on cuDNN over [B, H, L, D] strided views of ragged [T, H, D] views (one length only)."""
    def grid(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(0, (seqs, -1)).transpose(1, 2)

    qb, kb, vb = grid(q), grid(k), grid(v)
    gqa = q.shape[1] != k.shape[1]

    def call() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(0, 1)
    return call


def bench(layout: str, seqs: int, length: int) -> dict:
    heads, kv, dim, causal = LAYOUTS[layout]
    dt, dev = torch.bfloat16, torch.device("cuda")
    flops = 4 * seqs * length * length * heads * dim * (0.5 if causal else 1.0)
    row: dict = {"layout": layout, "shape": f"{seqs}x{length}", "us": {}, "tflops": {}, "max_diff": {}}
    torch.manual_seed(0)
    t = seqs * length
    qkv = torch.randn(t, (heads + 2 * kv) * dim, device=dev, dtype=dt)
    q, k, v = split_qkv(qkv, heads, kv, dim)
    meta = AttentionMetadata.build([length] * seqs, dev, causal=causal, padded=False)
    ref = make_backend("torch_flash", dev, dt)(q, k, v, meta).float()
    for name in candidates(dim, dt):
        try:
            attn = make_backend(name, dev, dt)
            plan = attn.plan(meta.cu_seqlens.cpu(), heads, kv, dim, causal)
            step = AttentionMetadata(meta.cu_seqlens, length, causal, plan=plan)
            row["max_diff"][name] = (attn(q, k, v, step).float() - ref).abs().max().item()
            row["us"][name] = cuda_time_us(lambda: attn(q, k, v, step))  # timed here, within this iteration
        except Exception as e:  # noqa: BLE001 - a kernel this GPU or build lacks is reported, not fatal
            row["us"][name] = f"{type(e).__name__}: {e}"[:200]
    try:
        call = cudnn_call(q, k, v, seqs, causal)
        row["max_diff"]["cudnn_dense"] = (call().float() - ref).abs().max().item()
        row["us"]["cudnn_dense"] = cuda_time_us(call)
    except Exception as e:  # noqa: BLE001
        row["us"]["cudnn_dense"] = f"{type(e).__name__}: {e}"[:200]
    try:  # PyTorch's ragged cuDNN entry (nested tensors'): contiguous [T, H, D] (its offsets are T x H x D)
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()

        def ragged() -> torch.Tensor:
            return torch.ops.aten._cudnn_attention_forward(qc, kc, vc, None, meta.cu_seqlens, meta.cu_seqlens,
                                                           length, length, False, 0.0, causal)[0]
        row["max_diff"]["cudnn_ragged"] = (ragged().float() - ref).abs().max().item()
        row["us"]["cudnn_ragged"] = cuda_time_us(ragged)
    except Exception as e:  # noqa: BLE001
        row["us"]["cudnn_ragged"] = f"{type(e).__name__}: {e}"[:200]
    row["tflops"] = {n: round(flops / us / 1e6, 1) for n, us in row["us"].items() if isinstance(us, float)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--out", default="perf/out/attention.json")
    args = ap.parse_args()
    rows = []
    for layout in args.layouts:
        for seqs, length in SHAPES:
            row = bench(layout, seqs, length)
            rows.append(row)
            cells = ", ".join(f"{n} {us:.0f} µs ({row['tflops'][n]} TFLOP/s, diff {row['max_diff'].get(n, 0):.3g})"
                              if isinstance(us, float) else f"{n} {us}" for n, us in row["us"].items())
            print(f"{layout} {row['shape']}: {cells}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
