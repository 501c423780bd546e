"""FP8 fidelity variants, emulated on the CPU on all-MiniLM-L6-v2's real weights.

    python perf/experiments/fp8_variants.py --passages 300 > perf/results/.../fp8_variants.log

Which change lifts the per-text cosine of FP8 against BF16 (perf/fp8_fidelity.py's corpus and
figures) to the speed issue's 0.995: finer scales (activations per 1 x 128 group, weights per
128 x 128 block, DeepSeek-V3's recipe) or keeping some projections in BF16 (the FFN's input or
output projection, the attention output, the first and last layer). Every FP8 product is emulated
in fp32 from e4m3-rounded operands, so the figures stand for the number format, not for the GPU's
kernels (whose rowwise figures came within 0.002 of the emulation's).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8_fidelity  # noqa: E402

import pergola.layers.fp8 as fp8  # noqa: E402
import pergola.layers.linear as linear  # noqa: E402
import pergola.models  # noqa: E402
from pergola.cli import default_model_folder  # noqa: E402
from pergola.layers.linear import Linear  # noqa: E402

FP8_MAX = 448.0


def fake_quantize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x [M, K] rounded through e4m3 with one scale per (rows x cols) block, back in fp32."""
    m, k = x.shape
    blocks = x.float().reshape(m // rows, rows, k // cols, cols)  # [M/r, r, K/c, c]
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / FP8_MAX
    return ((blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).reshape(m, k)


def use_scales(act_cols: int, weight_block: int) -> None:
    """Activations per 1 x act_cols group (0: per row), weights per weight_block^2 block (0: per output row)."""
    def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = w.shape
        dq = fake_quantize(w, weight_block, weight_block) if weight_block else fake_quantize(w, 1, k)
        return dq, torch.ones(1, n)  # (dequantized, unit scales): fp8_linear below multiplies in fp32

    def fp8_linear(x: torch.Tensor, w: torch.Tensor, _scale: torch.Tensor, bias: torch.Tensor | None = None):
        y = fake_quantize(x, 1, act_cols or x.shape[1]) @ w.t()
        return (y if bias is None else y + bias.float()).to(torch.bfloat16)

    linear.quantize_weight, linear.fp8_linear = quantize_weight, fp8_linear


def keep_bf16(pattern: str | None, ends: bool) -> Callable:
    """A quantize_layers that leaves projections whose name matches `pattern` (and, with `ends`,
    the first and last layer) in BF16."""
    def quantize_layers(model: torch.nn.Module, num_layers: int) -> list[str]:
        for i, layer in enumerate(fp8.layer_stack(model, num_layers)):
            for name, module in layer.named_modules():
                kept = (ends and i in (0, num_layers - 1)) or (pattern and re.search(pattern, name))
                if isinstance(module, Linear) and fp8.fits(module.weight) and not kept:
                    module.to_fp8()
        return []
    return quantize_layers


VARIANTS = [  # label, activation group, weight block, BF16 pattern (BERT's names), first/last layer
    ("every projection, rowwise scales (today)", 0, 0, None, False),
    ("activations per 1x128", 128, 0, None, False),
    ("weights per 128x128", 0, 128, None, False),
    ("activations 1x128, weights 128x128", 128, 128, None, False),
    ("FFN input in BF16", 0, 0, r"^intermediate\.", False),
    ("FFN output in BF16", 0, 0, r"^output\.dense$", False),
    ("attention output in BF16", 0, 0, r"^attention\.output\.", False),
    ("first and last layer in BF16", 0, 0, None, True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=300)
    args = p.parse_args()
    pergola.models.check_supported = lambda device, dtype: None  # FP8 emulated on the CPU
    original = linear.quantize_weight, linear.fp8_linear
    passages, queries = fp8_fidelity.corpus(args.passages)
    print("| variant | cosine min | p1 | mean | top-10 overlap | top-1 same |\n| --- | --- | --- | --- | --- | --- |")
    for label, act_cols, weight_block, pattern, ends in VARIANTS:
        if act_cols or weight_block:
            use_scales(act_cols, weight_block)
        else:
            linear.quantize_weight, linear.fp8_linear = original
        pergola.models.quantize_layers = keep_bf16(pattern, ends)
        r = fp8_fidelity.compare("minilm", default_model_folder(), "cpu", passages, queries, 10)
        c = r["cosine_fp8_vs_bf16"]
        print(f"| {label} | {c['min']:.4f} | {c['p1']:.4f} | {c['mean']:.4f} | {r['topk_overlap']['mean']:.3f} | "
              f"{r['top1_same']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
