"""FP8 projections (`--quantization fp8`): e4m3 weights with a scale per output channel, e4m3
activations with a scale per token, one `torch._scaled_mm` per matmul (cuBLASLt/CUTLASS rowwise).

What is quantized: the weight of every projection inside the transformer layers (q|k|v, o,
gate|up, down, BERT's intermediate/output), once, at load (`quantize_layers`). Embeddings, norms,
attention, pooling, sentence-transformers Dense modules and classification/score heads stay in
the model dtype (BF16). Each matmul's input is quantized on the fly by one Triton kernel
(`quantize_rows`: per-row amax, scale and the e4m3 values in one pass over x), and the product
comes back in BF16 with the bias, if any, added in the matmul's epilogue:

    y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_x[m] * s_w[n] (+ bias[n])

with s = amax / 448 (e4m3's largest finite value), q = round(v / s) clamped to +-448. Everything
is fixed-shape device work, so steps capture into CUDA graphs as in BF16.

Hardware: FP8 tensor cores start at compute capability 8.9 (Ada, Hopper); the CPU and older GPUs
are refused (`check_supported`), as is a float32/float16 model (rowwise-scaled FP8 matmuls write
BF16). Shapes: K and N must be multiples of 16 (cuBLASLt); a projection that is not keeps its
BF16 weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pergola.layers.fused import HAVE_TRITON, silu_and_mul, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12  # an all-zero row (padding) gets a tiny scale instead of a division by zero
MIN_CAPABILITY = (8, 9)
QUANTIZATIONS = ("none", "fp8")  # EngineConfig.quantization's choices (config.py spells them out too)


class Fp8Rows(NamedTuple):
    """An activation already quantized per row, which an FP8 projection takes as it is: what
    `GateUpLinear` hands its down projection (SiLU * mul and the quantization in one kernel)."""

    q: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] fp32


class QuantizationUnsupported(ValueError):
    """FP8 asked for where it cannot run (CPU, GPU below sm89, a non-BF16 model)."""


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse FP8 on the CPU, on GPUs without FP8 tensor cores, and for non-BF16 models."""
    if device.type != "cuda":
        raise QuantizationUnsupported(
            f"quantization fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
            f"this instance runs on the {device.type.upper()}: serve on a GPU (--device gpu) or use "
            f"--quantization none")
    if dtype != torch.bfloat16:
        raise QuantizationUnsupported(
            f"quantization fp8 needs dtype bfloat16 (FP8 matmuls write BF16), got {str(dtype).removeprefix('torch.')}: "
            f"use --dtype bfloat16 (or auto) or --quantization none")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise QuantizationUnsupported(
            f"quantization fp8 needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
            f"(FP8 tensor cores: L4/L40 Ada, H100/H200 Hopper, Blackwell); {device} is {name}, compute capability "
            f"{capability[0]}.{capability[1]}: use --quantization none on this GPU")


# --- reference implementations (CPU, and the tests' ground truth) ------------------------------
def quantize_rows_ref(x: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in out_dtype, scale [M, 1] fp32) with x ~ q * scale, per row.

    out_dtype=float32 gives the clamped value before the e4m3 rounding (what Triton's CPU
    interpreter can check: its fp8 conversion is not the hardware's).
    """
    x32 = x.float()
    # times the fp32 reciprocal, not a division: what PyTorch's CUDA division by a scalar does,
    # and what the kernel does, so the twins agree bit for bit
    scale = x32.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) * (1.0 / FP8_MAX)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(out_dtype), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] e4m3, scale [1, N] fp32): one scale per output channel."""
    q, scale = quantize_rows_ref(weight)
    return q, scale.view(1, -1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [R, K] * scale ([R, 1] per row, or [1, R] per output channel of a weight) -> fp32 [R, K]."""
    return q.float() * (scale.view(-1, 1) if scale.shape[0] == 1 else scale)


if HAVE_TRITON:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, n_cols, stride_x, FP8_MAX: tl.constexpr,
                              MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row: amax, scale = amax / FP8_MAX, q = clamp(x / scale) in q's dtype
        # (e4m3 on the GPU, fp32 in the interpreter's tests). x / scale rounded to nearest, as torch's.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_AMAX) * (1.0 / FP8_MAX)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _silu_mul_quantize_kernel(x_ptr, q_ptr, scale_ptr, n_cols, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                                  BLOCK: tl.constexpr):
        # x [M, 2I] gate | up (BF16) -> silu(gate) * up with the BF16 roundings of fused.silu_and_mul,
        # then quantized as _quantize_rows_kernel does: the [M, I] product never reaches memory.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dt = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        y = (act * up).to(dt).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), MIN_AMAX) * (1.0 / FP8_MAX)
        q = tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)


def launch_quantize_rows(x: torch.Tensor, out_dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel itself; also what the CPU tests run through Triton's interpreter."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK=block,
                                    num_warps=max(1, min(8, block // 512)))
    return q, scale


def launch_silu_mul_quantize(x: torch.Tensor, out_dtype: torch.dtype = FP8) -> Fp8Rows:
    """silu(gate) * up of x [M, 2I] (gate | up), quantized per row, in one Triton kernel."""
    x = x.contiguous()
    m, n = x.shape[0], x.shape[1] // 2
    q = torch.empty(m, n, dtype=out_dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(n)
        _silu_mul_quantize_kernel[(m,)](x, q, scale, n, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX, BLOCK=block,
                                        num_warps=max(1, min(8, block // 512)))
    return Fp8Rows(q, scale)


def silu_mul_quantize(x: torch.Tensor) -> Fp8Rows:
    """[M, 2I] gate | up -> silu(gate) * up [M, I] quantized per row (one kernel on CUDA)."""
    return launch_silu_mul_quantize(x) if use_triton(x) else Fp8Rows(*quantize_rows_ref(silu_and_mul(x)))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of x [M, K] (one kernel on CUDA): (q e4m3 [M, K], scale fp32 [M, 1])."""
    return launch_quantize_rows(x) if use_triton(x) else quantize_rows_ref(x)


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (BF16, or already quantized) @ weight [N, K]^T (e4m3, scale [1, N]) (+ bias [N]) -> [M, N] BF16.

    `weight.t()` is the column-major [K, N] operand the GPU kernel wants, with no copy. Fast
    accumulation (Hopper's FP8 accumulator, no periodic promotion to fp32) measured faster on
    large steps of the Qwen3-0.6B projections, with per-row cosines to the exact accumulation
    that round to 1 (perf/results/2026-12-04-017c6c0/NOTES.md). On the CPU, the same product in
    fp32 from the dequantized operands (PyTorch's CPU `_scaled_mm` takes row-wise scales in some
    versions only), which the tests use.
    """
    q, scale = x if isinstance(x, Fp8Rows) else quantize_rows(x)
    if not q.is_cuda:
        y = dequantize(q, scale) @ dequantize(weight, weight_scale).t()
        return (y if bias is None else y + bias.float()).to(torch.bfloat16)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, bias=bias,
                            out_dtype=torch.bfloat16, use_fast_accum=True)


def fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight meets the FP8 matmul's shape rule (K and N multiples of 16)."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def layer_stack(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's transformer layers: its ModuleList of `num_layers` entries."""
    stack = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers), None)
    if stack is None:
        raise ValueError(f"{type(model).__name__} has no list of {num_layers} layers to quantize")
    return stack


def quantize_layers(model: nn.Module, num_layers: int, bf16_layers: int = 0) -> list[str]:
    """Swap every projection of the transformer layers to FP8 (`Linear.to_fp8`) in place, but for
    the first and the last `bf16_layers` layers; heads, Dense modules and anything outside the
    layers keep their weights. -> names left in BF16 because of their shape.

    Why the ends stay in BF16: e4m3's 3-bit mantissa on every operand is the loss, not scales
    (finer ones changed nothing), so only fewer FP8 products lift the fidelity, and the first and
    last layers lifted it the most per product kept (perf/results/2026-12-05-614fe80-cpu/NOTES.md)."""
    from pergola.layers.linear import Linear

    skipped = []
    for index, layer in enumerate(layer_stack(model, num_layers)):
        if index < bf16_layers or index >= num_layers - bf16_layers:
            continue
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                if fits(module.weight):
                    module.to_fp8()
                else:
                    skipped.append(f"{index}.{name}")
    return skipped
