"""Fused elementwise kernels for decoder-style models (Triton on CUDA, PyTorch elsewhere).

Why: a Qwen3 layer written with plain PyTorch ops launches ~50 kernels (RMSNorm alone is ~7:
cast, square, mean, rsqrt, scale, cast, weight), so a 28-layer forward of 128 tokens is ~1,500
tiny kernels: about 4 ms of GPU time even inside a CUDA graph, against ~0.3 ms of matmuls.
Large batches pay too, since every unfused op re-reads [T, hidden] from memory. Fused, a layer
is ~9 kernels: RMSNorm, qkv matmul, q/k-norm+RoPE, attention, o matmul (+ residual), RMSNorm,
gate_up matmul, SiLU*mul (inside gate_up where measured faster), down matmul (+ residual). The
residual adds live in the matmuls' epilogues (pergola.layers.linear), not here.

Numerics follow Hugging Face: statistics in fp32, results rounded to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


# --- reference implementations (CPU, and the tests' ground truth) ------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y


def qk_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c, s = cos[positions].unsqueeze(1).to(qkv.dtype), sin[positions].unsqueeze(1).to(qkv.dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    q = rope(rms_norm_ref(q.reshape(t, num_heads, head_dim), q_weight, eps))
    k = rope(rms_norm_ref(k.reshape(t, num_kv_heads, head_dim), k_weight, eps))
    return q, k, v.reshape(t, num_kv_heads, head_dim)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        # One program per row [n_cols]: statistics in fp32, normalised value rounded, then * weight.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        xf = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_heads(base, w_ptr, c, s, eps, NUM: tl.constexpr, HP: tl.constexpr, HEAD_DIM: tl.constexpr):
        # RMSNorm over each of NUM heads [NUM, D] at `base`, then RoPE (half-split), in place.
        half: tl.constexpr = HEAD_DIM // 2
        heads = tl.arange(0, HP)
        cols = tl.arange(0, half)
        offs = heads[:, None] * HEAD_DIM + cols[None, :]
        m = (heads < NUM)[:, None]
        dt = base.dtype.element_ty
        x1 = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + offs, mask=m, other=0.0).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + cols).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + cols).to(tl.float32)[None, :]
        y1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(base + offs, (y1 * c - y2 * s).to(dt), mask=m)
        tl.store(base + half + offs, (y2 * c + y1 * s).to(dt), mask=m)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, row_stride, eps,
                             NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HP_Q: tl.constexpr, HP_K: tl.constexpr,
                             HEAD_DIM: tl.constexpr):
        # One program per token covers all its q and k heads (a [heads, D] tile each): at 16k
        # tokens a program per (token, head) meant 400k programs of 128 elements, 8x slower.
        token = tl.program_id(0).to(tl.int64)
        half: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, half)
        pos = tl.load(pos_ptr + token)
        dt = qkv_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * half + cols).to(dt).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * half + cols).to(dt).to(tl.float32)[None, :]
        row = qkv_ptr + token * row_stride
        _norm_rope_heads(row, qw_ptr, c, s, eps, NUM_Q, HP_Q, HEAD_DIM)
        _norm_rope_heads(row + NUM_Q * HEAD_DIM, kw_ptr, c, s, eps, NUM_K, HP_K, HEAD_DIM)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [T, H] (one kernel on CUDA)."""
    return launch_rms_norm(x, weight, eps) if use_triton(x) else rms_norm_ref(x, weight, eps)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Triton kernel itself; also what the CPU tests run through Triton's interpreter."""
    x = x.contiguous()
    t, h = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(t,)](x, weight, out, h, eps, BLOCK=triton.next_power_of_2(h))
    return out


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then RoPE on q and k, in place in qkv [T, (Hq + 2 Hkv) * D].

    Returns views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] with the token stride of qkv:
    the attention kernels only need a contiguous last dimension, so nothing is copied.
    """
    if not use_triton(qkv):
        return qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads,
                                head_dim, eps)
    t = qkv.shape[0]
    _qk_norm_rope_kernel[(t,)](
        qkv, q_weight, k_weight, cos, sin, positions, qkv.stride(0), eps, NUM_Q=num_heads, NUM_K=num_kv_heads,
        HP_Q=triton.next_power_of_2(num_heads), HP_K=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim)
    return split_qkv(qkv, num_heads, num_kv_heads, head_dim)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hkv) * D] -> views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (no copy)."""
    t = qkv.shape[0]
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv[:, :q_end].view(t, num_heads, head_dim), qkv[:, q_end:k_end].view(t, num_kv_heads, head_dim),
            qkv[:, k_end:].view(t, num_kv_heads, head_dim))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    if not use_triton(x):
        return silu_and_mul_ref(x)
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, n, BLOCK=block)
    return out
