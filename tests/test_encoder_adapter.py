"""The encoder's Triton adapter (python_models/encoder/model.py) without a server: what it hands
the stub when it answers through a response sender."""

from __future__ import annotations

import gc
import importlib.util
import sys
import weakref
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np

ADAPTER = Path(__file__).resolve().parents[1] / "python_models" / "encoder" / "model.py"


class FakeTensor:
    def __init__(self, name: str, value: np.ndarray) -> None:
        self.name, self.value = name, value


class FakeResponse:
    """Holds only the names, as the stub's response holds its own handles, not the Python objects."""

    def __init__(self, tensors: list[FakeTensor]) -> None:
        self.names = [t.name for t in tensors]


def load_adapter(monkeypatch) -> ModuleType:
    fake = ModuleType("triton_python_backend_utils")
    fake.Tensor, fake.InferenceResponse = FakeTensor, FakeResponse
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    spec = importlib.util.spec_from_file_location("encoder_adapter_under_test", ADAPTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_output_tensors_outlive_the_send(monkeypatch):
    """Triton 2.51's stub drops unrequested outputs inside send() with the GIL released, and a
    numpy array freed there kills a Python 3.12 stub (python_backend #390): the adapter keeps its
    tensors alive until send() has returned."""
    adapter = load_adapter(monkeypatch)
    model = adapter.TritonPythonModel.__new__(adapter.TritonPythonModel)
    made: list[weakref.ref] = []

    def tensors(options, req, wanted, pooled) -> list[FakeTensor]:
        out = [FakeTensor(name, pooled) for name in sorted(wanted)]
        made.extend(weakref.ref(t) for t in out)
        return out

    model._tensors = tensors
    alive_at_send: list[bool] = []
    sender = SimpleNamespace(send=lambda response, flags: (gc.collect(),
                                                           alive_at_send.append(all(r() is not None for r in made))))
    model._deliver(sender, None, None, None, {"EMBEDDING", "TOKEN_COUNT"}, np.zeros((1, 4), np.float32))
    assert alive_at_send == [True]
    gc.collect()
    assert all(r() is None for r in made)  # and let go of afterwards
