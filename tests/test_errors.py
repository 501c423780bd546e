"""Bad requests get a Triton error that says what to change; the server stays healthy."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import MAX_REQUEST_CHARS, MAX_TEXT_CHARS, MAX_TEXTS, TEXTS
from tritonclient.utils import InferenceServerException


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
    from pergola.triton.adapter import is_fatal_device_error

    assert is_fatal_device_error(RuntimeError(message)) is fatal


@pytest.mark.parametrize("cores,expected", [(1, 1), (2, 1), (16, 15)])
def test_cpu_instances_leave_a_core_to_triton(tmp_path, monkeypatch, cores, expected):
    """cpu_threads = 0: torch gets the cores this process may use less one (at least one); an
    explicit count is used as given; GPU instances are left alone; a negative count is refused."""
    import os

    import torch
    from pergola.config.engine import EngineConfig
    from pergola.triton.adapter import set_cpu_threads

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


IDS = np.array([[101, 7592, 2088, 102]], dtype=np.int64)  # [CLS] hello world [SEP]
ENCODER_CASES = {
    # PROMPT_LENGTHS equal to the length used to pool over no tokens: an all-zero vector, status OK.
    "prompt covers the text": ([("PROMPT_LENGTHS", np.array([[4]], np.int32), "INT32")],
                               r"PROMPT_LENGTHS\[0\] is 4 for a sequence of 4 tokens"),
    "prompt longer than the text": ([("PROMPT_LENGTHS", np.array([[9]], np.int32), "INT32")], r"PROMPT_LENGTHS\[0\] is 9"),
    "negative prompt": ([("PROMPT_LENGTHS", np.array([[-1]], np.int32), "INT32")], r"PROMPT_LENGTHS\[0\] is -1"),
    "prompt count": ([("PROMPT_LENGTHS", np.array([[0, 1]], np.int32), "INT32")],
                     "PROMPT_LENGTHS has 2 values for 1 sequences"),
}


@pytest.mark.parametrize("case", sorted(ENCODER_CASES))
def test_inconsistent_pretokenized_fields_are_refused(server, case):
    extra, message = ENCODER_CASES[case]
    base = [("INPUT_IDS", IDS, "INT64"), ("LENGTHS", np.array([[4]], np.int32), "INT32")]
    with pytest.raises(InferenceServerException, match=message) as err:
        infer_raw(server, base + extra, model="minilm_encoder")
    assert "INVALID_ARG" in str(err.value)
    good = infer_raw(server, base + [("PROMPT_LENGTHS", np.array([[1]], np.int32), "INT32")], model="minilm_encoder")
    assert np.abs(good.as_numpy("EMBEDDING")).sum() > 0


@pytest.mark.parametrize("extra,message", [
    ([("TOKEN_TYPE_IDS", np.array([[0, 0, 2, 1]], np.int64), "INT64")], r"TOKEN_TYPE_IDS must lie in \[0, 2\)"),
    ([("TOKEN_TYPE_IDS", np.array([[0, 1]], np.int64), "INT64")], "TOKEN_TYPE_IDS has 2 values for 4 tokens"),
    ([("TOP_N", np.array([[-2]], np.int32), "INT32")], "TOP_N=-2 must be positive"),
])
def test_reranker_encoder_fields_are_checked(server, extra, message):
    """An out-of-range token type would index past the embedding table (a device-side assert on
    a GPU, which ends the stub); a negative TOP_N silently dropped the best documents."""
    base = [("INPUT_IDS", IDS, "INT64"), ("LENGTHS", np.array([[4]], np.int32), "INT32")]
    with pytest.raises(InferenceServerException, match=message):
        infer_raw(server, base + extra, model="ce_encoder")
    assert infer_raw(server, base, model="ce_encoder").as_numpy("SCORE").shape == (1,)


def test_a_missing_required_input_is_named(server):
    with pytest.raises(InferenceServerException, match="input TEXT is required") as err:
        infer_raw(server, [("PROMPT_NAME", text_array(["query"]), "BYTES")])
    assert "INVALID_ARG" in str(err.value) and "deadlock" not in str(err.value)
    with pytest.raises(InferenceServerException, match="input DOCUMENTS is required"):
        infer_raw(server, [("QUERY", text_array(["q"]), "BYTES")], model="rerank")


@pytest.mark.parametrize("name", ["PROMPT_NAME", "ENCODING"])
def test_long_option_values_get_a_short_invalid_argument_over_grpc(server, name):
    """An error message that echoed an 8 KB value overflowed gRPC's header limit (RESOURCE_EXHAUSTED)."""
    with pytest.raises(InferenceServerException) as err:
        infer_raw(server, [("TEXT", text_array(["a"]), "BYTES"), (name, text_array(["x" * 8192]), "BYTES")])
    assert "INVALID_ARGUMENT" in str(err.value) and f"{name} is 8,192 bytes" in str(err.value)
    assert len(str(err.value)) < 500


def test_errors_do_not_echo_large_input_over_http(server):
    """(3 MB: Triton 2.51's HTTP server itself crashes on JSON bodies over ~4 MiB, Triton issue
    #5840; `pergola serve` restarts it, tests/test_hardening.py.)"""
    import json
    import urllib.error
    import urllib.request

    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["a"]},
                       {"name": "PROMPT_NAME", "shape": [1], "datatype": "BYTES", "data": ["p" * 3_000_000]}]}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/embed/infer", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert err.value.code == 400
    assert len(err.value.read()) < 500


@pytest.mark.parametrize("texts,message", [
    (["x" * (MAX_TEXT_CHARS + 1)], rf"TEXT\[0\] is {MAX_TEXT_CHARS + 1:,} characters; the limit is "
                                   rf"{MAX_TEXT_CHARS:,} characters \(max_text_chars, `pergola serve --max-text-chars`\)"),
    (["x" * 4 * (MAX_TEXT_CHARS + 1)], rf"TEXT\[0\] is {4 * (MAX_TEXT_CHARS + 1):,} bytes"),
    (["y" * (MAX_TEXT_CHARS // 2)] * (2 * MAX_REQUEST_CHARS // MAX_TEXT_CHARS + 1),
     r"the limit is [0-9,]+ characters \(max_request_chars"),
])
def test_size_limits_are_checked_before_tokenization(server, texts, message):
    with pytest.raises(InferenceServerException, match=message) as err:
        infer_raw(server, [("TEXT", text_array(texts), "BYTES")])
    assert "INVALID_ARG" in str(err.value)
    assert len(str(err.value)) < 500
