"""Fused elementwise kernels (Triton on CUDA, PyTorch elsewhere).

Why: a Qwen3 layer written with plain PyTorch ops launches ~50 kernels (RMSNorm alone is ~7:
cast, square, mean, rsqrt, scale, cast, weight), so a 28-layer forward of 128 tokens is ~1,500
tiny kernels, which at small batches take far more GPU time than the matmuls, even inside a CUDA graph.
Large batches pay too, since every unfused op re-reads [T, hidden] from memory. Fused, a layer
is ~9 kernels: RMSNorm, qkv matmul, q/k-norm+RoPE, attention, o matmul (+ residual), RMSNorm,
gate_up matmul, SiLU*mul (inside gate_up where measured faster), down matmul (+ residual). The
residual adds live in the matmuls' epilogues (pergola.layers.linear), not here. Encoders with RoPE
and a GLU (ModernBERT) take the same path: RoPE on q and k is one in-place kernel instead of ~18
(gathers, casts, halves, products, cat) and GELU * gate one instead of three.

Numerics follow Hugging Face: statistics in fp32, results rounded to the model dtype.

Folded norms (`PendingNorm`): a Qwen3 layer may skip its two RMSNorm kernels. RMSNorm(x) @ W^T =
diag(1/rms(x)) (x @ (W diag(g))^T): the gain g is folded into W once at load, the matmul reads the
raw residual stream x, and the kernel after the matmul (q/k-norm + RoPE, SiLU * mul, or the Triton
gated matmul's epilogue) multiplies each row by 1/rms(x), which it computes from x itself. 56 of a
batch-1 forward's 288 kernels go (pergola.models.qwen3.Qwen3Model.fold_norms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


@dataclass(frozen=True)
class PendingNorm:
    """A product computed from the raw residual stream `x` [T, hidden] with an RMSNorm's gain
    folded into the weight: each of its rows still needs x's 1 / rms (with the norm's eps)."""

    x: torch.Tensor
    eps: float

    def inv_rms(self) -> torch.Tensor:  # [T, 1] fp32
        x32 = self.x.float()
        return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def apply_ref(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, N] * 1/rms(x) per row, rounded to y's dtype (the PyTorch twin of the kernels)."""
        return (y.float() * self.inv_rms()).to(y.dtype)


# The activations of Hugging Face configs (`hidden_act`, `hidden_activation`) that pergola serves,
# and each one's code in the GLU kernel (_activate).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
ACT_CODES = {"silu": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3}
assert ACT_CODES.keys() == ACTIVATIONS.keys(), "every served activation needs its GLU kernel code"


# --- reference implementations (CPU, and the tests' ground truth) ------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def qk_norm_rope_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, eps: float, pending: PendingNorm | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    if pending is not None:
        qkv = pending.apply_ref(qkv)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rope_ref(rms_norm_ref(q.reshape(t, num_heads, head_dim), q_weight, eps), cos, sin, positions)
    k = rope_ref(rms_norm_ref(k.reshape(t, num_kv_heads, head_dim), k_weight, eps), cos, sin, positions)
    return q, k, v.reshape(t, num_kv_heads, head_dim)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE (half-split) on x [T, H, D] as HF computes it: the fp32 tables cast to x's dtype,
    x * cos + rotate_half(x) * sin; cos/sin [P, D/2], positions [T]."""
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + pre_bias) over the last dimension (pre_bias: a matmul's bias not yet added)."""
    if pre_bias is not None:
        x = x + pre_bias
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def act_and_mul_ref(x: torch.Tensor, act: str = "silu", pending: PendingNorm | None = None) -> torch.Tensor:
    """[T, 2I] (a | b) -> act(a) * b [T, I], each result rounded to x's dtype as HF's GLUs do."""
    if pending is not None:
        x = pending.apply_ref(x)
    a, b = x.chunk(2, dim=-1)
    return ACTIVATIONS[act](a) * b


def silu_and_mul_ref(x: torch.Tensor, pending: PendingNorm | None = None) -> torch.Tensor:
    return act_and_mul_ref(x, "silu", pending)


if HAVE_TRITON:

    @triton.jit
    def _inv_rms(row_ptr, n_cols, eps, BLOCK: tl.constexpr):
        # 1 / rms of one row [n_cols] (fp32 statistics), as RMSNorm computes it.
        cols = tl.arange(0, BLOCK)
        xf = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row [n_cols]: statistics in fp32, normalised value rounded, then * weight
        # (none: the gain was folded into the next matmul's weight).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        xf = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_WEIGHT:
            y = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * y
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_kernel(x_ptr, pre_ptr, w_ptr, b_ptr, out_ptr, n_cols, eps, HAS_PRE: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # One program per row [n_cols]: LayerNorm(x + pre) with fp32 statistics, one rounding at the end.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_PRE:
            x += tl.load(pre_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        inv = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        y = xc * inv * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_heads(base, w_ptr, c, s, eps, pre, NUM: tl.constexpr, HP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         PENDING: tl.constexpr):
        # RMSNorm over each of NUM heads [NUM, D] at `base`, then RoPE (half-split), in place.
        # PENDING: first times `pre`, the row's 1/rms of a folded input norm, rounded to the dtype as
        # the normalised product would have been.
        half: tl.constexpr = HEAD_DIM // 2
        heads = tl.arange(0, HP)
        cols = tl.arange(0, half)
        offs = heads[:, None] * HEAD_DIM + cols[None, :]
        m = (heads < NUM)[:, None]
        dt = base.dtype.element_ty
        x1 = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + offs, mask=m, other=0.0).to(tl.float32)
        if PENDING:
            x1 = (x1 * pre).to(dt).to(tl.float32)
            x2 = (x2 * pre).to(dt).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + cols).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + cols).to(tl.float32)[None, :]
        y1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        _rotate_store(base, offs, m, y1, y2, c, s, half)

    @triton.jit
    def _rotate_store(base, offs, m, x1, x2, c, s, half: tl.constexpr):
        # RoPE of heads split in halves x1 | x2 [heads, D/2] (fp32), stored at base + offs (| + half).
        dt = base.dtype.element_ty
        tl.store(base + offs, (x1 * c - x2 * s).to(dt), mask=m)
        tl.store(base + half + offs, (x2 * c + x1 * s).to(dt), mask=m)

    @triton.jit
    def _rope_heads(base, c, s, NUM: tl.constexpr, HP: tl.constexpr, HEAD_DIM: tl.constexpr):
        # RoPE on NUM heads [NUM, D] at `base`, in place.
        half: tl.constexpr = HEAD_DIM // 2
        heads = tl.arange(0, HP)
        cols = tl.arange(0, half)
        offs = heads[:, None] * HEAD_DIM + cols[None, :]
        m = (heads < NUM)[:, None]
        x1 = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + offs, mask=m, other=0.0).to(tl.float32)
        _rotate_store(base, offs, m, x1, x2, c, s, half)

    @triton.jit
    def _rope_row(cos_ptr, sin_ptr, pos_ptr, token, x_ptr, HEAD_DIM: tl.constexpr):
        # cos, sin [1, D/2] of `token`'s position: the fp32 tables rounded to x's dtype (as HF).
        dt = x_ptr.dtype.element_ty
        half: tl.constexpr = HEAD_DIM // 2
        cols = tl.arange(0, half)
        pos = tl.load(pos_ptr + token)
        c = tl.load(cos_ptr + pos * half + cols).to(dt).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * half + cols).to(dt).to(tl.float32)[None, :]
        return c, s

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, q_stride, k_stride, cos_ptr, sin_ptr, pos_ptr, NUM_Q: tl.constexpr,
                     NUM_K: tl.constexpr, HP_Q: tl.constexpr, HP_K: tl.constexpr, HEAD_DIM: tl.constexpr):
        # One program per token, all its q and k heads (as _qk_norm_rope_kernel, without the norms).
        token = tl.program_id(0).to(tl.int64)
        c, s = _rope_row(cos_ptr, sin_ptr, pos_ptr, token, q_ptr, HEAD_DIM)
        _rope_heads(q_ptr + token * q_stride, c, s, NUM_Q, HP_Q, HEAD_DIM)
        _rope_heads(k_ptr + token * k_stride, c, s, NUM_K, HP_K, HEAD_DIM)

    @triton.jit
    def _activate(x, ACT: tl.constexpr):
        # fp32 -> fp32, codes as ACT_CODES: SiLU, GELU (erf), GELU (tanh), ReLU.
        if ACT == 0:
            y = x / (1.0 + tl.exp(-x))
        elif ACT == 1:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        elif ACT == 2:  # tanh(u) = 1 - 2 / (1 + e^2u), saturating to +-1 at either end
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = 0.5 * x * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * u)))
        else:
            y = tl.maximum(x, 0.0)
        return y

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, row_stride, eps,
                             x_ptr, x_cols, x_eps, PENDING: tl.constexpr, X_BLOCK: tl.constexpr,
                             NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HP_Q: tl.constexpr, HP_K: tl.constexpr,
                             HEAD_DIM: tl.constexpr):
        # One program per token covers all its q and k heads (a [heads, D] tile each): at 16k
        # tokens a program per (token, head) meant 400k programs of 128 elements, 8x slower.
        # PENDING: qkv came from the raw residual x [T, x_cols] with the input norm's gain folded
        # into the weight: q, k and v rows are first multiplied by x's 1/rms (v in place here).
        token = tl.program_id(0).to(tl.int64)
        pre = 1.0
        if PENDING:
            pre = _inv_rms(x_ptr + token * x_cols, x_cols, x_eps, X_BLOCK)
        dt = qkv_ptr.dtype.element_ty
        c, s = _rope_row(cos_ptr, sin_ptr, pos_ptr, token, qkv_ptr, HEAD_DIM)
        row = qkv_ptr + token * row_stride
        _norm_rope_heads(row, qw_ptr, c, s, eps, pre, NUM_Q, HP_Q, HEAD_DIM, PENDING)
        _norm_rope_heads(row + NUM_Q * HEAD_DIM, kw_ptr, c, s, eps, pre, NUM_K, HP_K, HEAD_DIM, PENDING)
        if PENDING:  # v [NUM_K, D], scaled in place
            heads = tl.arange(0, HP_K)
            dims = tl.arange(0, HEAD_DIM)
            v_ptrs = row + (NUM_Q + NUM_K) * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
            vm = (heads < NUM_K)[:, None]
            v = tl.load(v_ptrs, mask=vm, other=0.0).to(tl.float32)
            tl.store(v_ptrs, (v * pre).to(dt), mask=vm)

    @triton.jit
    def _act_and_mul_kernel(x_ptr, out_ptr, n_tokens, n_cols, r_ptr, r_cols, r_eps, PENDING: tl.constexpr,
                            R_BLOCK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ACT: tl.constexpr):
        # act(gate) * up on a [ROWS, BLOCK] tile; PENDING (ROWS == 1): gate | up came from the raw
        # residual r [T, r_cols] (post-attention norm's gain folded into the weight): both are first
        # multiplied by r's 1/rms and rounded.
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # [1, BLOCK]
        mask = (rows < n_tokens) & (cols < n_cols)
        gate = tl.load(x_ptr + rows * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + rows * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if PENDING:
            tl.static_assert(ROWS == 1, "a pending norm's 1/rms is per row: one row a program (glu_tile)")
            inv = _inv_rms(r_ptr + tl.program_id(0).to(tl.int64) * r_cols, r_cols, r_eps, R_BLOCK)
            gate = (gate * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
            up = (up * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        act = _activate(gate, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [T, H] (one kernel on CUDA); weight None: no gain
    (folded into the next matmul)."""
    return launch_rms_norm(x, weight, eps) if use_triton(x) else rms_norm_ref(x, weight, eps)


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Triton kernel itself; also what the CPU tests run through Triton's interpreter."""
    x = x.contiguous()
    t, h = x.shape
    out = torch.empty_like(x)
    _rms_norm_kernel[(t,)](x, x if weight is None else weight, out, h, eps, HAS_WEIGHT=weight is not None,
                           BLOCK=triton.next_power_of_2(h))
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + pre_bias) of x [T, H] in one kernel on CUDA: a post-norm layer's matmul adds
    its residual in the epilogue and leaves its bias to this kernel (pergola.models.bert)."""
    return launch_layer_norm(x, weight, bias, eps, pre_bias) if use_triton(x) else \
        layer_norm_ref(x, weight, bias, eps, pre_bias)


def launch_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                      pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel of `layer_norm` (also run by the CPU tests through Triton's interpreter)."""
    x = x.contiguous()
    t, h = x.shape
    out = torch.empty_like(x)
    _layer_norm_kernel[(t,)](x, x if pre_bias is None else pre_bias, weight, weight if bias is None else bias, out,
                             h, eps, HAS_PRE=pre_bias is not None, HAS_BIAS=bias is not None,
                             BLOCK=triton.next_power_of_2(h))
    return out


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose [T, H] CUDA forward is `layer_norm`'s one Triton kernel: PyTorch's took 8.7 of
    ModernBERT's 72.7 ms at 20 x 4,096 tokens on the H100 (perf/results/2026-12-06-1f57b5f/NOTES.md).
    Same parameters and state-dict keys as nn.LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.weight is not None and use_triton(x):  # (the kernel takes a gain)
            return launch_layer_norm(x, self.weight, self.bias, self.eps)
        return super().forward(x)


def pending_args(pending: PendingNorm | None, like: torch.Tensor) -> tuple[torch.Tensor, int, float, bool, int]:
    """(x, columns, eps, PENDING, block) for a kernel that applies a folded norm's 1/rms per row;
    placeholders (never read) without one."""
    if pending is None:
        return like, 1, 0.0, False, 1
    x = pending.x
    if not x.is_contiguous() or x.shape[0] != like.shape[0]:
        raise ValueError(f"a pending norm needs a contiguous [{like.shape[0]}, hidden] input, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    return x, x.shape[1], pending.eps, True, triton.next_power_of_2(x.shape[1])


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, pending: PendingNorm | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm then RoPE on q and k, in place in qkv [T, (Hq + 2 Hkv) * D].

    Returns views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] with the token stride of qkv:
    the attention kernels only need a contiguous last dimension, so nothing is copied.
    pending: qkv is the product of the raw residual stream with the input norm's gain folded
    into the weight; q, k and v get that norm's 1/rms per token first (v in place).
    """
    if not use_triton(qkv):
        return qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads,
                                head_dim, eps, pending)
    return launch_qk_norm_rope(qkv, q_weight, k_weight, cos, sin, positions, num_heads, num_kv_heads, head_dim,
                               eps, pending)


def launch_qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_dim: int, eps: float, pending: PendingNorm | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel of `qk_norm_rope` (also run by the CPU tests through Triton's interpreter)."""
    t = qkv.shape[0]
    x, x_cols, x_eps, has_pending, x_block = pending_args(pending, qkv)
    _qk_norm_rope_kernel[(t,)](
        qkv, q_weight, k_weight, cos, sin, positions, qkv.stride(0), eps, x, x_cols, x_eps, PENDING=has_pending,
        X_BLOCK=x_block, NUM_Q=num_heads, NUM_K=num_kv_heads,
        HP_Q=triton.next_power_of_2(num_heads), HP_K=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim)
    return split_qkv(qkv, num_heads, num_kv_heads, head_dim)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, (Hq + 2 Hkv) * D] -> views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (no copy)."""
    t = qkv.shape[0]
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (qkv[:, :q_end].view(t, num_heads, head_dim), qkv[:, q_end:k_end].view(t, num_kv_heads, head_dim),
            qkv[:, k_end:].view(t, num_kv_heads, head_dim))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (half-split) on q [T, Hq, D] and k [T, Hkv, D]; cos/sin [P, D/2] fp32, positions [T].

    On CUDA one kernel rotates q and k in place (views of a fresh qkv product, which nothing else
    reads) and returns them; elsewhere new tensors with HF's arithmetic (rope_ref).
    """
    d = q.shape[-1]
    heads_contiguous = q.stride(2) == k.stride(2) == 1 and q.stride(1) == k.stride(1) == d
    if use_triton(q) and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0 and heads_contiguous:
        return launch_rope_qk(q, k, cos, sin, positions)
    return rope_ref(q, cos, sin, positions), rope_ref(k, cos, sin, positions)


def launch_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of `rope_qk`, in place (also run by the CPU tests through Triton's interpreter).
    q and k: heads contiguous ([T, H, D] with strides (row, D, 1)), any row stride."""
    t, hq, d = q.shape
    hk = k.shape[1]
    _rope_kernel[(t,)](q, k, q.stride(0), k.stride(0), cos.contiguous(), sin.contiguous(), positions,
                       NUM_Q=hq, NUM_K=hk, HP_Q=triton.next_power_of_2(hq), HP_K=triton.next_power_of_2(hk),
                       HEAD_DIM=d)
    return q, k


def act_and_mul(x: torch.Tensor, act: str = "silu", pending: PendingNorm | None = None) -> torch.Tensor:
    """[T, 2I] (a | b) -> act(a) * b [T, I] in one kernel on CUDA (`act` a key of ACTIVATIONS);
    pending: a | b still need the folded post-attention norm's 1/rms per row."""
    return launch_act_and_mul(x, act, pending) if use_triton(x) else act_and_mul_ref(x, act, pending)


def silu_and_mul(x: torch.Tensor, pending: PendingNorm | None = None) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]; pending: gate | up still need the folded
    post-attention norm's 1/rms per row."""
    return act_and_mul(x, "silu", pending)


def launch_act_and_mul(x: torch.Tensor, act: str = "silu", pending: PendingNorm | None = None) -> torch.Tensor:
    """The Triton kernel of `act_and_mul` (also run by the CPU tests through Triton's interpreter)."""
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    r, r_cols, r_eps, has_pending, r_block = pending_args(pending, x)
    rows, block = glu_tile(n, has_pending)
    _act_and_mul_kernel[(triton.cdiv(t, rows), triton.cdiv(n, block))](
        x, out, t, n, r, r_cols, r_eps, PENDING=has_pending, R_BLOCK=r_block, ROWS=rows, BLOCK=block,
        ACT=ACT_CODES[act])
    return out


def glu_tile(n: int, pending: bool, elements: int = 1024) -> tuple[int, int]:
    """(rows, columns) of a GLU program's tile for I = n: `elements` a program with no masked column
    block, so every program moves the same bytes. ModernBERT's I = 1152 as 1,024-wide blocks left a
    second block of 128 per row; as [8, 128] tiles it divides evenly, and a 20 x 4,096-token layer
    went from 251 to 153 µs on an H200 (perf/results/2026-12-07-e7b1fc6). A pending norm's 1/rms is
    per row, so that path keeps one row a program."""
    block = n & -n  # the largest power of two dividing n
    if pending or block < 128:
        return 1, min(elements, triton.next_power_of_2(n))
    block = min(block, elements)
    return elements // block, block
