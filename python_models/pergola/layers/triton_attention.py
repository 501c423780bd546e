"""Ragged attention as one small Triton kernel: for the short steps of online queries.

Why another kernel: at one 128-token text the general-purpose kernels cost more than the math:
a few µs per layer call for ~67 MFLOP, i.e. the time is set-up, scheduling and tail, and 28
layers pay it at every batch-1 query. This kernel does no planning and has no split-KV merge: one
program per (block of BM query tokens, query head) walks its keys in BN-token blocks with an
online softmax (FlashAttention's recurrence, exp2 with the scale folded in) and writes its rows once.

Ragged without a per-step schedule: a program's rows are BM consecutive tokens of the flat
batch, which may belong to several sequences. Each row finds its own sequence [start, end) in
`cu_seqlens` on the device, the program walks the keys from its first row's start to its last
row's end (causal: to its last row), and masks per element. So the grid depends only on the
(padded) token count, and the call is graph-safe with no host work. The price is wasted key
blocks when many short sequences share a program's rows, and a serial key loop per program:
the start-up probe (pergola.layers.attention_probe) times it against the other kernels per
class of step size and only picks it where it wins: with Qwen3-0.6B heads, the short steps, and
where FlashInfer is not installed, every graph shape measured (perf/results/2026-12-03-87e4492/
NOTES.md). Qwen3's q/k-norm + RoPE folded into this kernel was measured and dropped: each program
re-normalised every key block, slower than a separate norm kernel.

Layouts: q [T, Hq, D], k / v [T, Hkv, D], any token and head strides with a contiguous last
dimension (views into the fused qkv projection are read in place); GQA maps query head h to
key/value head h // (Hq / Hkv). Output [T, Hq, D], contiguous.
"""

from __future__ import annotations

import math

import torch

from pergola.layers.attention import AttentionBackend, AttentionMetadata
from pergola.layers.fused import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _seq_bounds(cu_ptr, num_cu, rows, CU_BLOCK: tl.constexpr):
        # Sequence [start, end) of each row: start = the last offset <= row, end = the first > row.
        # cu_seqlens [num_cu] is read in blocks so one compiled kernel serves any sequence count.
        big = 1 << 30
        start = tl.zeros_like(rows)
        end = tl.zeros_like(rows) + big
        for j0 in range(0, num_cu, CU_BLOCK):
            j = j0 + tl.arange(0, CU_BLOCK)
            cu = tl.load(cu_ptr + j, mask=j < num_cu, other=big)
            before = cu[None, :] <= rows[:, None]  # [BM, CU_BLOCK]
            start = tl.maximum(start, tl.max(tl.where(before, cu[None, :], 0), axis=1))
            end = tl.minimum(end, tl.min(tl.where(before, big, cu[None, :]), axis=1))
        return start, end

    # Token and sequence counts change every step: not specialised on (no recompiles mid-serving).
    @triton.jit(do_not_specialize=["num_cu", "num_tokens"])
    def _ragged_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr, num_cu, num_tokens,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
        window,  # WINDOWED: keys with |q - k| < window (causal: 0 <= q - k < window)
        CAUSAL: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, CU_BLOCK: tl.constexpr, WINDOWED: tl.constexpr,
    ):
        # Program (m, h): query rows [m BM, m BM + BM) of head h, against kv head h // GROUP.
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < num_tokens
        d = tl.arange(0, HEAD_DIM)
        # q first: its load is in flight while the rows' sequence bounds are read.
        q = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BM, D]
        start, end = _seq_bounds(cu_ptr, num_cu, rows, CU_BLOCK)
        end = tl.minimum(end, num_tokens)
        lo = tl.min(tl.where(row_ok, start, num_tokens), axis=0)
        if CAUSAL:
            hi = tl.minimum(pid_m * BM + BM, num_tokens)  # the last row sees keys up to itself
        else:
            hi = tl.max(tl.where(row_ok, end, 0), axis=0)
        if WINDOWED:  # only the keys of the rows' band: the loop costs BM + 2 window keys, not the sequence
            lo = tl.maximum(lo, pid_m * BM - window + 1)
            if not CAUSAL:
                hi = tl.minimum(hi, pid_m * BM + BM - 1 + window)
        m_i = tl.full([BM], float("-inf"), tl.float32)  # running max of the scaled scores
        l_i = tl.zeros([BM], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([BM, HEAD_DIM], tl.float32)
        for n0 in range(lo, hi, BN):
            cols = n0 + tl.arange(0, BN)
            col_ok = cols < hi
            k = tl.load(k_ptr + cols[:, None].to(tl.int64) * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=col_ok[:, None], other=0.0)  # [BN, D]
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [BM, BN]
            ok = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
            if CAUSAL:
                ok = ok & (cols[None, :] <= rows[:, None])
            if WINDOWED:
                ok = ok & (rows[:, None] - cols[None, :] < window) & (cols[None, :] - rows[:, None] < window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + cols[:, None].to(tl.int64) * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=col_ok[:, None], other=0.0)  # [BN, D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool,
                     block_m: int | None = None, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 3, window: int = 0) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per sequence of the flat batch: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].

    block_m: query rows per program; by default 16 up to 128 tokens (more programs for a tiny
    step) and 64 above (fewer key re-reads), the faster of the two at each size
    (perf/results/2026-12-03-87e4492/NOTES.md).
    window > 0: sliding-window attention, keys with |q - k| < window (causal: 0 <= q - k < window);
    each program walks only its rows' band of keys (models/padded.py's BandAttention).
    Half precision on a GPU (its dots would run FP32 inputs as TF32); FP32 anywhere in the
    interpreter.
    """
    t, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads or head_dim & (head_dim - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"triton attention needs Hq % Hkv == 0, a power-of-two head_dim and a contiguous last "
                         f"dimension (got q {tuple(q.shape)} strides {q.stride()}, k {tuple(k.shape)})")
    if q.is_cuda and q.dtype == torch.float32:
        raise ValueError("triton attention runs in float16/bfloat16 on a GPU; for float32 use attention_backend "
                         "sdpa (or a half-precision compute dtype)")
    out = torch.empty(t, heads, head_dim, dtype=q.dtype, device=q.device)
    block_m = block_m or (16 if t <= 128 else 64)
    grid = (triton.cdiv(t, block_m), heads)
    _ragged_attention_kernel[grid](
        q, k, v, out, cu_seqlens, cu_seqlens.numel(), t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        math.log2(math.e) / math.sqrt(head_dim), window,
        CAUSAL=causal, GROUP=heads // kv_heads, HEAD_DIM=head_dim, BM=block_m, BN=block_n, CU_BLOCK=16,
        WINDOWED=window > 0, num_warps=num_warps, num_stages=num_stages)
    return out


# The largest head_dim whose windows run on this kernel rather than FlashAttention-2's: at 64
# (ModernBERT, |q - k| < 65) it took 298-375 µs a layer call where FA2 took 500-737; at 256
# (EmbeddingGemma, < 257) 72-681 against FA2's 67-469 (perf/results/2026-12-06-1f57b5f/NOTES.md).
WINDOW_MAX_HEAD_DIM = 64


def triton_window_takes(q: torch.Tensor) -> bool:
    """Whether `ragged_attention(window=...)` runs `q`'s step: Triton, CUDA, half precision and a
    power-of-two head_dim up to WINDOW_MAX_HEAD_DIM (models/padded.py's BandAttention takes
    FlashAttention-2's windowed kernel or SDPA otherwise)."""
    d = q.shape[-1]
    return (HAVE_TRITON and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d & (d - 1) == 0
            and d <= WINDOW_MAX_HEAD_DIM)


class TritonAttention(AttentionBackend):
    """`ragged_attention` behind the backend interface: no planning, graph-safe, CUDA only."""

    name = "triton"
    graph_safe = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cuda" or not HAVE_TRITON:
            raise ValueError("attention backend triton needs a CUDA device and the triton package")
        super().__init__(device, dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return ragged_attention(q, k, v, meta.cu_seqlens, meta.causal)
