"""ENCODING: float32 (default), float16, int8 and packed sign bits; unit tests of
pergola.text.encodings, then the real server over gRPC and HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import BF16_ATOL, TEST_DEVICE, TEXTS
from pergola.text.encodings import OUTPUTS, check_encoding, encoded_outputs, quantize
from pergola.text.errors import RequestError
from tritonclient.utils import InferenceServerException

TOL = 1e-5 if TEST_DEVICE == "cpu" else BF16_ATOL  # how far one text's fp32 may move between batches
SHAPES = {"float32": (np.float32, 384), "float16": (np.float16, 384), "int8": (np.int8, 384),
          "binary": (np.uint8, 48), "ubinary": (np.uint8, 48)}


def assert_codes_match(codes: np.ndarray, fp32: np.ndarray, encoding: str, tol: float = TOL) -> None:
    """codes == quantize(fp32), except where fp32 lies within `tol` of a rounding boundary: there
    a float32 that differs in its last bits may land on the other side."""
    if encoding == "int8":
        scaled = fp32 * 127
        near = np.abs(scaled - np.rint(scaled)) > 0.5 - 127 * tol
        slack = np.where(near, int(np.ceil(127 * tol)), 0)
        assert (np.abs(codes.astype(np.int32) - quantize(fp32, "int8")) <= slack).all()
    else:
        bits = np.unpackbits(codes, axis=-1, count=fp32.shape[1]).astype(bool)
        assert ((bits == (fp32 > 0)) | (np.abs(fp32) <= tol)).all()


# --- pergola.text.encodings, no server ------------------------------------------------------------
def test_check_encoding_names_and_defaults():
    assert check_encoding(None, normalize=True) == "float32"
    assert check_encoding("ubinary", normalize=True) == "binary"
    assert check_encoding("binary", normalize=False) == "binary"  # sign bits need no scale
    assert check_encoding("float16", normalize=False) == "float16"
    with pytest.raises(RequestError, match="float32, float16, int8, binary, ubinary"):
        check_encoding("fp8", normalize=True)
    with pytest.raises(RequestError, match="send NORMALIZE=true"):
        check_encoding("int8", normalize=False)


def test_quantize_known_values():
    x = np.array([[1.0, -1.0, 0.5, -0.5 / 127, 0.0, 0.004, -0.3, 1e-9, -1e-9, 0.2]], dtype=np.float32)
    np.testing.assert_array_equal(quantize(x, "int8"), [[127, -127, 64, 0, 0, 1, -38, 0, 0, 25]])
    # 10 dims -> 2 bytes, first dim in the high bit, the last byte padded with zeros
    np.testing.assert_array_equal(quantize(x, "binary"), [[0b10100101, 0b01000000]])
    assert quantize(x, "float16").dtype == np.float16
    assert quantize(x, "float32") is x


def test_quantize_matches_sentence_transformers_ubinary(reference):
    from sentence_transformers.util.quantization import quantize_embeddings

    np.testing.assert_array_equal(quantize(reference, "binary"), quantize_embeddings(reference, "ubinary"))


def test_int8_scale_is_fixed_per_row(reference):
    """Unlike calibrated int8, a row's codes do not depend on the rows quantised with it."""
    batch = quantize(reference, "int8")
    for i in range(len(reference)):
        np.testing.assert_array_equal(quantize(reference[i:i + 1], "int8"), batch[i:i + 1])


def test_encoded_outputs_fill_one_and_leave_the_others_empty(reference):
    dtypes = dict(OUTPUTS.values())  # tensor -> dtype
    for encoding, (name, _) in OUTPUTS.items():
        out = encoded_outputs(reference, encoding)
        assert {k: v.dtype for k, v in out.items()} == dtypes
        assert {k: v.shape[1] > 0 for k, v in out.items()} == {k: k == name for k in dtypes}
        assert all(v.shape[0] == len(reference) for v in out.values())
    bits = encoded_outputs(reference, "float16")["EMBEDDING_FP16"]
    np.testing.assert_array_equal(bits.view(np.float16), reference.astype(np.float16))


# --- the real server --------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", sorted(SHAPES))
def test_each_encoding_has_its_dtype_and_shape(client, encoding):
    dtype, width = SHAPES[encoding]
    out = client.embed(TEXTS[2:5], encoding=encoding)
    assert out.dtype == dtype and out.shape == (3, width)


def test_encodings_agree_with_float32(client):
    fp32 = client.embed(TEXTS)
    np.testing.assert_allclose(client.embed(TEXTS, encoding="float16"), fp32, atol=1e-3, rtol=0)
    assert_codes_match(client.embed(TEXTS, encoding="int8"), fp32, "int8")
    assert_codes_match(client.embed(TEXTS, encoding="binary"), fp32, "binary")


def test_quantized_batched_equals_single(server):
    """A text's codes are the same alone and in a batch (a fixed scale, no batch calibration)."""
    from pergola_client import PergolaClient

    with PergolaClient(server.grpc_url) as client:
        for encoding in ("int8", "binary"):
            batched = client.embed(TEXTS, encoding=encoding)
            for i, text in enumerate(TEXTS[:6]):  # the long text among them
                single = client.embed([text], encoding=encoding)
                if not np.array_equal(single, batched[i:i + 1]):  # only where its fp32 sits on a boundary
                    assert_codes_match(batched[i:i + 1], client.embed([text]), encoding)
                    assert_codes_match(single, client.embed([text]), encoding)


def test_encoding_after_dimensions(client):
    short = client.embed(TEXTS[:4], dimensions=100)
    int8 = client.embed(TEXTS[:4], dimensions=100, encoding="int8")
    binary = client.embed(TEXTS[:4], dimensions=100, encoding="binary")
    assert int8.shape == (4, 100) and binary.shape == (4, 13)
    assert_codes_match(int8, short, "int8")
    assert_codes_match(binary, short, "binary")


def test_binary_without_normalisation(client):
    raw = client.embed(TEXTS[:4], normalize=False)
    assert_codes_match(client.embed(TEXTS[:4], normalize=False, encoding="binary"), raw, "binary")


def infer_error(server, model: str, inputs: list[tuple[str, np.ndarray, str]]) -> InferenceServerException:
    c = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, data, dtype in inputs:
        tensors.append(grpcclient.InferInput(name, list(data.shape), dtype))
        tensors[-1].set_data_from_numpy(data)
    with pytest.raises(InferenceServerException) as err:
        c.infer(model, tensors)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    return err.value


def test_bad_encodings_are_refused(server):
    text = ("TEXT", np.array([b"a"], dtype=object), "BYTES")
    err = infer_error(server, "embed", [text, ("ENCODING", np.array([b"int4"], dtype=object), "BYTES")])
    assert "ENCODING='int4' is unknown; use one of float32, float16, int8, binary, ubinary" in err.message()
    err = infer_error(server, "embed", [text, ("ENCODING", np.array([b"int8"], dtype=object), "BYTES"),
                                        ("NORMALIZE", np.array([False]), "BOOL")])
    assert "NORMALIZE=true" in err.message()
    ids = [("INPUT_IDS", np.array([[101, 102]], np.int64), "INT64"), ("LENGTHS", np.array([[2]], np.int32), "INT32")]
    err = infer_error(server, "minilm_encoder", [*ids, ("ENCODING", np.array([[b"half"]], dtype=object), "BYTES")])
    assert "ENCODING='half' is unknown" in err.message()
    assert server.alive()


def test_pretokenized_encoder_takes_encoding(server, st_model):
    from pergola_client import PergolaClient

    ids = [st_model.tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in TEXTS[:3]]
    with PergolaClient(server.grpc_url) as c:
        fp32 = c.embed_tokens(ids, model="minilm_encoder")
        binary = c.embed_tokens(ids, model="minilm_encoder", encoding="binary")
        half = c.embed_tokens(ids, model="minilm_encoder", encoding="float16", dimensions=64)
    assert binary.shape == (3, 48)
    assert_codes_match(binary, fp32, "binary")
    assert half.dtype == np.float16 and half.shape == (3, 64)


def test_plain_json_request_still_gets_every_output(server):
    """A JSON request that lists no outputs gets them all: none may be FP16, which Triton cannot
    write as JSON (so EMBEDDING_FP16 is UINT16 bits)."""
    def post(body: dict) -> dict:
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/embed/infer", data=json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            return {o["name"]: o for o in json.loads(r.read())["outputs"]}

    text = {"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": ["hello", "world"]}
    out = post({"inputs": [text]})
    assert out["EMBEDDING"]["shape"] == [2, 384] and out["EMBEDDING_FP16"]["shape"] == [2, 0]
    half = post({"inputs": [text, {"name": "ENCODING", "shape": [1], "datatype": "BYTES", "data": ["float16"]}],
                 "outputs": [{"name": "EMBEDDING_FP16"}]})["EMBEDDING_FP16"]
    values = np.array(half["data"], dtype=np.uint16).view(np.float16).reshape(half["shape"])
    np.testing.assert_allclose(values, np.array(out["EMBEDDING"]["data"]).reshape(2, 384), atol=1e-3)


def test_embed_command_encoding(server):
    out = subprocess.run(
        [sys.executable, "-m", "pergola.cli", "embed", "--url", server.grpc_url, "--encoding", "binary", TEXTS[0]],
        capture_output=True, text=True, timeout=60, check=True,
    )
    data = json.loads(out.stdout)
    assert data["encoding"] == "binary"
    row = data["data"][0]["embedding"]
    assert len(row) == 48 and all(isinstance(b, int) and 0 <= b < 256 for b in row)
