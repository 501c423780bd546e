"""The attention-backend contract: one registry of names, capabilities declared per class, and
kernels that agree on a ragged batch (SDPA on the CPU; every kernel built here on a GPU).
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from pergola.config.engine import ATTENTION_BACKENDS, EngineConfig
from pergola.layers import attention
from pergola.layers.attention import BACKENDS, AttentionBackend, AttentionMetadata, make_backend
from pergola.layers.attention_probe import candidates
from pergola.layers.triton_attention import TritonAttention

CLASSES = [attention.SdpaAttention, attention.TorchFlashAttention, attention.FlashInferFA2,
           attention.FlashInferFA3, attention.FlashAttention4, TritonAttention]


def test_config_choices_are_the_registry():
    assert set(ATTENTION_BACKENDS) == {"auto", *BACKENDS} and len(ATTENTION_BACKENDS) == len(BACKENDS) + 1
    for f in fields(EngineConfig):
        if f.name in ("attention_backend", "eager_attention_backend"):
            assert f.metadata["choices"] == ATTENTION_BACKENDS


def test_every_registered_name_has_a_class_that_declares_its_capabilities():
    assert {cls.name for cls in CLASSES} == set(BACKENDS)
    for cls in CLASSES:
        assert issubclass(cls, AttentionBackend)
        entry = BACKENDS[cls.name]
        assert entry.make is cls or cls is TritonAttention  # triton's module imports attention's: built lazily
        for capability in ("needs_padding", "needs_plan", "graph_safe"):
            assert isinstance(getattr(cls, capability), bool), (cls.name, capability)
        assert not (cls.needs_padding and cls.graph_safe)  # a padded grid's shape changes every step
        assert cls.needs_plan == (cls.plan is not AttentionBackend.plan), cls.name


def test_probe_candidates_come_from_the_registry(monkeypatch):
    # Every availability rule says yes: all registered kernels but SDPA are candidates, torch_flash first.
    monkeypatch.setattr(attention, "HAVE_TRITON", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention, "flashinfer_ready", lambda template, head_dim, dtype: True)
    monkeypatch.setattr(attention, "fa4_ready", lambda opt_in: opt_in)
    names = candidates(128, torch.bfloat16, probe_fa4=True)
    assert names[0] == "torch_flash" and set(names) == set(BACKENDS) - {"sdpa"}
    assert "flash_attn4" not in candidates(128, torch.bfloat16, probe_fa4=False)


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(ValueError, match="torch_flash"):
        make_backend("flash_attn9", torch.device("cpu"), torch.float32)


def ragged_inputs(lengths: list[int], heads: int, kv_heads: int, dim: int, device: str, dtype: torch.dtype):
    t = sum(lengths)
    torch.manual_seed(0)
    return tuple(torch.randn(t, h, dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))


def per_sequence(q, k, v, lengths: list[int], causal: bool) -> torch.Tensor:
    """SDPA on each sequence alone, FP32: what any ragged kernel must return."""
    out, start, group = [], 0, q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_each_sequence_alone(causal):
    lengths = [5, 1, 12, 3]
    q, k, v = ragged_inputs(lengths, 4, 2, 16, "cpu", torch.float32)
    attn = make_backend("auto", torch.device("cpu"), torch.float32)
    assert attn.name == "sdpa"
    meta = AttentionMetadata.build(lengths, torch.device("cpu"), causal, padded=attn.needs_padding)
    meta.plan = attn.plan(meta.cu_seqlens, 4, 2, 16, causal)
    torch.testing.assert_close(attn(q, k, v, meta), per_sequence(q, k, v, lengths, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "sdpa"])
def test_gpu_backends_match_each_sequence_alone(name):
    """Eagerly, and (graph-safe kernels) replayed from a CUDA graph with the plan made for its key."""
    from pergola.layers.cudagraph import capture

    device = torch.device("cuda")
    try:
        attn = make_backend(name, device, torch.bfloat16)
    except (ImportError, ValueError) as e:  # an optional package, or a GPU it has no kernels for
        pytest.skip(f"{name}: {e}")
    lengths, heads, kv_heads, dim = [100, 1, 37, 250], 16, 8, 128
    q, k, v = ragged_inputs(lengths, heads, kv_heads, dim, "cuda", torch.bfloat16)
    expected = per_sequence(q, k, v, lengths, causal=True)
    cu_host = torch.tensor([0, 100, 101, 138, 388], dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens=cu_host.to(device), max_seqlen=max(lengths), causal=True)
    meta.plan = attn.plan(cu_host, heads, kv_heads, dim, True)
    torch.testing.assert_close(attn(q, k, v, meta).float(), expected, atol=2e-2, rtol=2e-2)
    if attn.graph_safe:
        key = (len(lengths), sum(lengths))
        meta.plan = attn.plan(cu_host, heads, kv_heads, dim, True, graph_key=key)
        out = torch.empty_like(q)
        attn(q, k, v, meta)  # warm-up: kernels compiled before the capture
        graph = torch.cuda.CUDAGraph()
        capture(graph, lambda: out.copy_(attn(q, k, v, meta)))
        graph.replay()
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def per_sequence_band(q, k, v, lengths: list[int], causal: bool, window: int) -> torch.Tensor:
    """SDPA on each sequence alone with keys |q - k| < window (causal: 0 <= q - k < window), FP32."""
    out, start, group = [], 0, q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        d = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
        mask = (d >= 0) & (d < window) if causal else d.abs() < window
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        start += n
    return torch.cat(out)


def band_attention(q, k, v, lengths: list[int], causal: bool, window: int) -> torch.Tensor:
    from pergola.models.padded import BandAttention

    meta = AttentionMetadata.build(lengths, q.device, causal, padded=False)
    positions = torch.cat([torch.arange(n, device=q.device) for n in lengths])
    return BandAttention(meta, positions, max(lengths))(q, k, v, window)


@pytest.mark.parametrize("causal", [True, False])
def test_band_attention_matches_each_sequence_alone(causal):
    """The padded SDPA path (CPU, FP32 GPU): sequences longer and shorter than the window."""
    lengths = [40, 3, 17, 70]
    q, k, v = ragged_inputs(lengths, 4, 2, 16, "cpu", torch.float32)
    got = band_attention(q, k, v, lengths, causal, window=9)
    torch.testing.assert_close(got, per_sequence_band(q, k, v, lengths, causal, 9), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_flash_window_matches_each_sequence_alone(causal):
    """BF16 on the GPU, FlashAttention-2's windowed varlen kernel (BandAttention's fallback where
    Triton cannot run): the same band as the padded path (ModernBERT's 65 = 128 // 2 + 1; GQA as
    Gemma3), eager and replayed; and BandAttention itself (the Triton kernel) agrees."""
    from pergola.layers.attention import TorchFlashAttention
    from pergola.layers.cudagraph import capture

    lengths, window = [300, 1, 64, 65, 66, 500], 65
    q, k, v = ragged_inputs(lengths, 8, 4, 64, "cuda", torch.bfloat16)
    assert TorchFlashAttention.takes(q)
    expected = per_sequence_band(q, k, v, lengths, causal, window)
    meta = AttentionMetadata.build(lengths, q.device, causal, padded=False)
    torch.testing.assert_close(TorchFlashAttention.windowed(q, k, v, meta, window).float(), expected,
                               atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(band_attention(q, k, v, lengths, causal, window).float(), expected,
                               atol=2e-2, rtol=2e-2)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    capture(graph, lambda: out.copy_(TorchFlashAttention.windowed(q, k, v, meta, window)))
    graph.replay()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim,window", [(12, 12, 64, 65), (3, 1, 256, 257)])  # ModernBERT, Gemma3
def test_triton_window_matches_each_sequence_alone(causal, heads, kv_heads, dim, window):
    """BF16 on the GPU, pergola's Triton kernel with a band: the same keys as the padded path,
    for texts shorter and longer than the window, eager and replayed in a graph."""
    from pergola.layers.cudagraph import capture
    from pergola.layers.triton_attention import ragged_attention

    lengths = [300, 1, window - 1, window, window + 1, 700]
    q, k, v = ragged_inputs(lengths, heads, kv_heads, dim, "cuda", torch.bfloat16)
    expected = per_sequence_band(q, k, v, lengths, causal, window)
    meta = AttentionMetadata.build(lengths, q.device, causal, padded=False)
    run = lambda: ragged_attention(q, k, v, meta.cu_seqlens, causal, window=window)  # noqa: E731
    torch.testing.assert_close(run().float(), expected, atol=2e-2, rtol=2e-2)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    capture(graph, lambda: out.copy_(run()))
    graph.replay()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
