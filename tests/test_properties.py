"""Property: a random pre-tokenized request to NAME_encoder is either answered exactly as a
reference computation says (Hugging Face transformers on the same weights, each sequence alone)
or refused with INVALID_ARG when it breaks a rule. Never answered wrongly, never an INTERNAL error."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from conftest import MAX_TEXTS, MIN_COSINE, TEST_DEVICE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VOCAB = 30522
MAX_LEN = 256  # all-MiniLM-L6-v2's limit
HIDDEN = 384


@dataclass
class Request:
    ids: np.ndarray  # [1, T] int64
    lengths: np.ndarray  # [1, n] int32
    prompt_lengths: np.ndarray | None  # [1, m] int32
    dimensions: int | None
    normalize: bool | None

    def problems(self) -> list[str]:
        """The rules a server must enforce, written independently of pergola's validation."""
        out = []
        lengths, ids = self.lengths.reshape(-1), self.ids.reshape(-1)
        if lengths.size == 0 or lengths.size > MAX_TEXTS:
            out.append("sequence count")
        if (lengths < 1).any() or (lengths > MAX_LEN).any():
            out.append("sequence length")
        if int(lengths.sum()) != ids.size:
            out.append("lengths vs ids")
        if ids.size and (ids.min() < 0 or ids.max() >= VOCAB):
            out.append("vocabulary")
        if self.prompt_lengths is not None:
            skips = self.prompt_lengths.reshape(-1)
            if skips.size != lengths.size or (skips < 0).any() or (skips >= lengths).any():
                out.append("prompt lengths")
        if self.dimensions is not None and not 0 <= self.dimensions <= HIDDEN:
            out.append("dimensions")
        return out


def rarely(draw, p: int = 10) -> bool:
    """True about once in `p` draws: each field is broken in some requests, not in most."""
    return draw(st.integers(0, p - 1)) == 0


@st.composite
def requests(draw) -> Request:
    n = draw(st.integers(0, 4)) if rarely(draw, 10) else draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(-1, 300) if rarely(draw) else st.integers(1, 30), min_size=n, max_size=n))
    total = max(0, sum(lengths)) + (draw(st.sampled_from([1, -1])) if rarely(draw) else 0)
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=max(0, total), max_size=max(0, total)))
    if ids and rarely(draw):
        ids[draw(st.integers(0, len(ids) - 1))] = draw(st.sampled_from([-1, VOCAB, 2**40]))
    prompt_lengths = None
    if draw(st.booleans()):
        m = n + (draw(st.sampled_from([1, -1])) if rarely(draw) else 0)
        skips = [draw(st.integers(-1, 32)) if rarely(draw) else draw(st.integers(0, max(0, length - 1)))
                 for length in (lengths + [5])[:max(m, 0)]]
        prompt_lengths = np.array([skips], dtype=np.int32)
    dimensions = draw(st.one_of(st.none(), st.integers(-2, HIDDEN + 2) if rarely(draw) else st.integers(0, HIDDEN)))
    normalize = draw(st.one_of(st.none(), st.booleans()))
    return Request(np.array([ids], dtype=np.int64), np.array([lengths], dtype=np.int32), prompt_lengths,
                   dimensions, normalize)


@pytest.fixture(scope="module")
def hf_model(minilm_folder):
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(minilm_folder), torch_dtype=torch.float32).eval()


def reference(hf_model, req: Request) -> np.ndarray:
    """Each sequence alone through transformers; mean over its tokens after the prompt; then
    Matryoshka truncation and normalisation (all-MiniLM-L6-v2 normalises by default)."""
    import torch

    rows = []
    start = 0
    skips = req.prompt_lengths.reshape(-1) if req.prompt_lengths is not None else None
    for i, n in enumerate(req.lengths.reshape(-1)):
        ids = torch.from_numpy(req.ids.reshape(-1)[start:start + n].copy())[None]
        start += n
        with torch.no_grad():
            hidden = hf_model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        skip = int(skips[i]) if skips is not None else 0
        rows.append(hidden[skip:].mean(0).numpy())
    out = np.stack(rows)
    if req.dimensions:
        out = out[:, :req.dimensions]
    if req.normalize is not False:
        out = out / np.linalg.norm(out, axis=1, keepdims=True)
    return out


def send(server, req: Request):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    tensors = []
    for name, data, dtype in (("INPUT_IDS", req.ids, "INT64"), ("LENGTHS", req.lengths, "INT32"),
                              ("PROMPT_LENGTHS", req.prompt_lengths, "INT32"),
                              ("DIMENSIONS", None if req.dimensions is None else np.array([[req.dimensions]], np.int32),
                               "INT32"),
                              ("NORMALIZE", None if req.normalize is None else np.array([[req.normalize]]), "BOOL")):
        if data is not None:
            t = grpcclient.InferInput(name, list(data.shape), dtype)
            t.set_data_from_numpy(data)
            tensors.append(t)
    return client.infer("minilm_encoder", tensors).as_numpy("EMBEDDING")


OUTCOMES = {"answered": 0, "refused": 0}


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(req=requests())
def test_pretokenized_requests_are_answered_right_or_refused(server, hf_model, req):
    from tritonclient.utils import InferenceServerException

    problems = req.problems()
    try:
        out = send(server, req)
    except InferenceServerException as e:
        assert "INVALID_ARG" in str(e), str(e)  # refused as the client's to fix, never INTERNAL
        assert problems, f"a valid request was refused: {e}"
        OUTCOMES["refused"] += 1
        return
    OUTCOMES["answered"] += 1
    assert not problems, f"answered a request that breaks {problems}"
    expected = reference(hf_model, req)
    assert out.shape == expected.shape and np.isfinite(out).all()
    cos = (out * expected).sum(1) / np.linalg.norm(out, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), np.linalg.norm(expected, axis=1),
                               rtol=1e-3 if TEST_DEVICE == "cpu" else 1e-2)


@pytest.mark.server  # reads what the server test above saw: in its tier
def test_the_property_saw_both_outcomes():
    """The generator is not so broken that every request is refused (or none is)."""
    assert OUTCOMES["answered"] >= 20 and OUTCOMES["refused"] >= 10, OUTCOMES
