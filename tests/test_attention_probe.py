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

    def timing(attn, heads, kv_heads, head_dim, causal, shape, device, dtype):
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
    assert ap.candidates(128, torch.bfloat16) == ["torch_flash"]
