"""pergola's Triton ragged-attention kernel (pergola.layers.triton_attention) on the CPU.

Its indexing — rows of one program spanning several sequences, each finding its own [start, end)
in cu_seqlens, causal and bidirectional masks, GQA, strided q/k/v views, the padding sequence of
a graph bucket, empty sequences, sliding windows — runs through Triton's interpreter in FP32 against SDPA per
sequence. BF16 on the GPU, eagerly and inside graphs: tests/test_gpu.py.
"""

from __future__ import annotations

import sys

import pytest
import torch
from pergola.layers.attention_probe import candidates
from triton_interp import run_in_interpreter

KERNEL_CHECK = r"""
import torch
import torch.nn.functional as F
from pergola.layers.fused import split_qkv
from pergola.layers.triton_attention import ragged_attention

def reference(q, k, v, lengths, causal, window=0):
    out, start, group = [], 0, q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start:start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        i = torch.arange(n)
        d = i[:, None] - i[None, :]  # query - key
        mask = (d >= 0) if causal else torch.ones(n, n, dtype=torch.bool)
        if window:
            mask = mask & (d.abs() < window)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(out)

torch.manual_seed(0)
heads, kv_heads, dim = 4, 2, 32
# one long text; texts straddling 16-row blocks; one-token texts; empty sequences at the end
# (cu_seqlens repeats its last offset, as a graph bucket's unused sequences do)
for lengths in ([37], [20, 3, 1, 17, 9], [1] * 19 + [5], [12, 30, 0, 0]):
    for causal in (True, False):
        t = sum(lengths)
        # q/k/v as views into one fused tensor, as the model hands them over
        q, k, v = split_qkv(torch.randn(t, (heads + 2 * kv_heads) * dim), heads, kv_heads, dim)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        got = ragged_attention(q, k, v, cu, causal, block_m=16, block_n=16)
        torch.testing.assert_close(got, reference(q, k, v, [n for n in lengths if n], causal),
                                   atol=1e-5, rtol=1e-5)
        # sliding windows: narrower than a block, spanning blocks, wider than any text
        for window in (3, 21, 64):
            got = ragged_attention(q, k, v, cu, causal, block_m=16, block_n=16, window=window)
            torch.testing.assert_close(got, reference(q, k, v, [n for n in lengths if n], causal, window),
                                       atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_ragged_attention_in_the_interpreter():
    run_in_interpreter(KERNEL_CHECK)


def test_triton_kernel_is_a_probe_candidate_only_with_a_gpu(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # keep FlashInfer out of the list
    monkeypatch.setitem(sys.modules, "flashinfer.jit.attention", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert candidates(128, torch.bfloat16) == ["torch_flash"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert candidates(128, torch.bfloat16) == ["torch_flash", "triton"]


def test_triton_backend_needs_cuda():
    from pergola.layers.attention import make_backend

    with pytest.raises(ValueError, match="CUDA"):
        make_backend("triton", torch.device("cpu"), torch.bfloat16)

