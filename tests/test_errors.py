"""Bad requests get a Triton error that says what to change; the server stays healthy."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import MAX_TEXTS, TEXTS


def infer_raw(server, inputs: list[tuple[str, np.ndarray, str]], model: str = "embed"):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, data, dtype in inputs:
        t = grpcclient.InferInput(name, list(data.shape), dtype)
        t.set_data_from_numpy(data)
        tensors.append(t)
    return c.infer(model, tensors)


def text_array(items: list) -> np.ndarray:
    return np.array([t.encode() if isinstance(t, str) else t for t in items], dtype=object)


CASES = {
    "empty request": ([("TEXT", np.array([], dtype=object), "BYTES")], "TEXT is empty"),
    "empty string": ([("TEXT", text_array(["ok", ""]), "BYTES")], "TEXT[1] is an empty string"),
    "invalid utf-8": ([("TEXT", text_array(["ok", b"caf\xe9 \xff"]), "BYTES")], "TEXT[1] is not valid UTF-8"),
    "wrong dtype": ([("TEXT", np.array([1, 2], dtype=np.int32), "INT32")], "TEXT"),
    "wrong shape": ([("TEXT", text_array(["a", "b", "c", "d"]).reshape(2, 2), "BYTES")], "TEXT"),
    "too many texts": ([("TEXT", text_array(["x"] * (MAX_TEXTS + 1)), "BYTES")], f"the limit is {MAX_TEXTS}"),
    "too long, truncation off": (
        [("TEXT", text_array(["word " * 400]), "BYTES"), ("TRUNCATE", np.array([False]), "BOOL")],
        "over this model's limit of 256",
    ),
    "unknown prompt": (
        [("TEXT", text_array(["a"]), "BYTES"), ("PROMPT_NAME", text_array(["nope"]), "BYTES")],
        "unknown prompt name 'nope'",
    ),
    "dimensions too large": (
        [("TEXT", text_array(["a"]), "BYTES"), ("DIMENSIONS", np.array([385], dtype=np.int32), "INT32")],
        "DIMENSIONS=385 is out of range",
    ),
    "negative dimensions": (
        [("TEXT", text_array(["a"]), "BYTES"), ("DIMENSIONS", np.array([-3], dtype=np.int32), "INT32")],
        "DIMENSIONS=-3 is out of range",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_refused_and_server_recovers(server, case):
    inputs, message = CASES[case]
    with pytest.raises(InferenceServerException) as err:
        infer_raw(server, inputs)
    assert message in str(err.value), str(err.value)
    assert server.alive()
    good = infer_raw(server, [("TEXT", text_array(TEXTS[:2]), "BYTES")]).as_numpy("EMBEDDING")
    assert good.shape == (2, 384) and np.isfinite(good).all()


def test_unknown_model(server):
    with pytest.raises(InferenceServerException, match="unknown model|not found"):
        infer_raw(server, [("TEXT", text_array(["a"]), "BYTES")], model="no_such_model")


def test_bad_pretokenized_input_is_refused(server):
    ids = np.array([[101, 7592, 999999]], dtype=np.int64)
    lengths = np.array([[3]], dtype=np.int32)
    with pytest.raises(InferenceServerException, match=r"INPUT_IDS must lie in \[0, 30522\)"):
        infer_raw(server, [("INPUT_IDS", ids, "INT64"), ("LENGTHS", lengths, "INT32")], model="minilm_encoder")
    with pytest.raises(InferenceServerException, match="LENGTHS add up to 5"):
        infer_raw(server, [("INPUT_IDS", ids, "INT64"), ("LENGTHS", np.array([[5]], np.int32), "INT32")],
                  model="minilm_encoder")


def test_error_in_one_request_does_not_fail_its_batch_neighbours(server):
    """Bad and good requests sent together: only the bad ones fail."""
    from concurrent.futures import ThreadPoolExecutor

    def call(i: int):
        texts = ["", "x"] if i % 3 == 0 else [f"text number {i}"]
        try:
            return infer_raw(server, [("TEXT", text_array(texts), "BYTES")]).as_numpy("EMBEDDING")
        except InferenceServerException as e:
            return e

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(24)))
    for i, r in enumerate(results):
        assert isinstance(r, InferenceServerException) == (i % 3 == 0)


@pytest.mark.parametrize("message,fatal", [
    ("CUDA error: device-side assert triggered", True),
    ("CUDA error: an illegal memory access was encountered", True),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("LENGTHS add up to 3 but INPUT_IDS has 4 tokens", False),
])
def test_fatal_device_errors_are_told_apart(message, fatal):
    """Only a poisoned CUDA context ends the encoder's stub (the supervisor then reloads it)."""
    from pergola.triton_io import is_fatal_device_error

    assert is_fatal_device_error(RuntimeError(message)) is fatal


@pytest.mark.parametrize("cores,expected", [(1, 1), (2, 1), (16, 15)])
def test_cpu_instances_leave_a_core_to_triton(tmp_path, monkeypatch, cores, expected):
    """cpu_threads = 0: torch gets the cores this process may use less one (at least one); an
    explicit count is used as given; GPU instances are left alone; a negative count is refused."""
    import os

    import torch

    from pergola.config import EngineConfig
    from pergola.triton_io import set_cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(EngineConfig(model_dir=str(tmp_path), device="cpu")) == expected
        assert torch.get_num_threads() == expected
        assert set_cpu_threads(EngineConfig(model_dir=str(tmp_path), device="cpu", cpu_threads=3)) == 3
        assert set_cpu_threads(EngineConfig(model_dir=str(tmp_path), device="cuda:0")) is None
        assert torch.get_num_threads() == 3  # untouched by the GPU instance
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model_dir=str(tmp_path), cpu_threads=-1)
