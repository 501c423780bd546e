"""The start-up attention probe picks the fastest kernel per step size and survives failing kernels.

Kernel timings are faked here (the real probe runs on the GPU machine: tests/test_gpu.py); what
is tested is the choice made from them.
"""

from __future__ import annotations

import pytest
import torch
from pergola.layers import attention_probe as ap


class FakeBackend:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def fake_kernels(monkeypatch):
    # µs per call: "small" wins graph-sized steps, "large" wins 16k-token steps, "broken" raises.
    speed = {"small": (10, 100), "large": (20, 50), "broken": (1, 1)}

    def make(name, device, dtype):
        if name == "broken":
            raise RuntimeError("no kernel image for this GPU")
        return FakeBackend(name)

    def timing(attn, heads, kv_heads, head_dim, causal, shape, device, dtype, graphed=False):
        assert graphed == (shape in ap.SMALL_SHAPES)  # graph-sized steps are timed in graphs
        small, large = speed[attn.name]
        return small if shape in ap.SMALL_SHAPES else large

    monkeypatch.setattr(ap, "make_backend", make)
    monkeypatch.setattr(ap, "time_backend", timing)


def run(names):
    return ap.probe(16, 8, 128, True, torch.device("cpu"), torch.bfloat16, names=names)


def test_probe_picks_fastest_per_step_size(fake_kernels):
    result = run(["small", "large"])
    assert (result.graph, result.eager) == ("small", "large")
    assert set(result.backends) == {"small", "large"}
    assert set(result.micros["small"]) == {f"{s}x{n}" for s, n in ap.SMALL_SHAPES + ap.LARGE_SHAPES}


def test_probe_picks_a_kernel_per_graph_step_class(fake_kernels, monkeypatch):
    # "short" wins steps up to 512 tokens, "long" the larger graph steps: two rules.
    def timing(attn, heads, kv_heads, head_dim, causal, shape, device, dtype, graphed=False):
        tokens = shape[0] * shape[1]
        return {"short": 5 if tokens <= 512 else 90, "long": 12 if tokens <= 512 else 40}[attn.name]

    monkeypatch.setattr(ap, "time_backend", timing)
    result = run(["short", "long"])
    assert result.graph_rules == [(512, "short"), (max(ap.GRAPH_CLASSES), "long")]
    assert result.graph == "short" and result.eager == "long"


def test_failing_kernel_is_left_out(fake_kernels):
    result = run(["broken", "large"])
    assert (result.graph, result.eager) == ("large", "large")
    assert "broken" not in result.backends


def test_single_candidate_is_not_timed(fake_kernels, monkeypatch):
    monkeypatch.setattr(ap, "time_backend", lambda *a, **k: pytest.fail("timed a lone candidate"))
    result = run(["small"])
    assert (result.graph, result.eager) == ("small", "small")


def test_flashinfer_not_ready_without_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "flashinfer.jit.attention", None)
    # as on a machine without CUDA, so pergola's Triton kernel is out too (its gating:
    # tests/test_triton_attention.py); only PyTorch's FA2 is left
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ap.candidates(128, torch.bfloat16) == ["torch_flash"]


@pytest.mark.parametrize("opt_in,major,importable,expected", [
    (True, 9, True, True),     # Hopper, installed, asked for
    (True, 10, True, True),    # Blackwell
    (False, 9, True, False),   # not asked for: its JIT compile stays out of start-up
    (True, 8, True, False),    # Ampere: not a supported GPU
    (True, 9, False, False),   # not installed
])
def test_fa4_candidate_gating(monkeypatch, opt_in, major, importable, expected):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setitem(sys.modules, "flashinfer.jit.attention", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))
    fake = types.ModuleType("flash_attn.cute") if importable else None
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn") if importable else None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake)
    names = ap.candidates(128, torch.bfloat16, probe_fa4=opt_in)
    assert ("flash_attn4" in names) == expected
    assert names[0] == "torch_flash"


def test_flash_attn4_needs_cuda():
    from pergola.layers.attention import make_backend

    with pytest.raises(ValueError, match="CUDA"):
        make_backend("flash_attn4", torch.device("cpu"), torch.bfloat16)
