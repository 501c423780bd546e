"""The engine without Triton, against sentence-transformers on the same weights (FP32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TEXTS, cosine_rows, derived_folder
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import ModelFolderError, load_model_spec
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.pooling import finish
from pergola.text.tokenization import TextTokenizer


def embed(engine: Engine, texts: list[str], prompt: str | None = None, **kw) -> np.ndarray:
    enc = TextTokenizer(engine.spec).encode(texts, prompt_name=prompt)
    pooled = engine.encode([EncodeRequest(enc.input_ids, enc.lengths, enc.prompt_lengths)])[0]
    return finish(pooled, kw.get("dimensions", 0), kw.get("normalize", engine.spec.normalize))


@pytest.fixture(scope="module")
def engine(minilm_folder) -> Engine:
    return Engine(EngineConfig(model_dir=str(minilm_folder)))


def test_spec_reads_sentence_transformers_files(minilm_folder):
    spec = load_model_spec(minilm_folder)
    assert (spec.architecture, spec.pooling, spec.normalize, spec.max_seq_length) == ("bert", "mean", True, 256)


def test_bad_folder_says_what_is_missing(tmp_path):
    with pytest.raises(ModelFolderError, match="no config.json"):
        load_model_spec(tmp_path)


def test_matches_sentence_transformers(engine, reference):
    out = embed(engine, TEXTS)
    assert out.shape == reference.shape and out.dtype == np.float32
    assert cosine_rows(out, reference).min() >= 0.9999
    np.testing.assert_allclose(out, reference, atol=1e-5)


def test_batched_equals_single(engine):
    batched = embed(engine, TEXTS)
    for i, text in enumerate(TEXTS):
        assert np.abs(embed(engine, [text])[0] - batched[i]).max() <= 1e-5


def test_last_step_marks_lie_within_the_call_in_order(engine):
    """Engine.last_step_marks, which the adapter's timing marks read: the last step's host phases,
    then its result on the host, in that order inside encode()."""
    import time

    before = time.monotonic_ns()
    embed(engine, TEXTS[:2])
    marks = engine.last_step_marks
    assert list(marks) == ["gathered", "filled", "planned", "queued", "launched", "on_host"]
    assert before < marks["gathered"] and list(marks.values()) == sorted(marks.values())
    assert marks["on_host"] <= time.monotonic_ns()


def test_requests_share_steps_without_changing_results(minilm_folder, engine):
    """A tiny token budget splits requests across steps and mixes them; results stay put."""
    small = Engine(EngineConfig(model_dir=str(minilm_folder), max_batch_tokens=40, max_batch_seqs=3))
    tok = TextTokenizer(engine.spec)
    encs = [tok.encode(TEXTS[:5]), tok.encode(TEXTS[5:])]
    reqs = [EncodeRequest(e.input_ids, e.lengths) for e in encs]
    a = small.encode(reqs)
    b = [engine.encode([r])[0] for r in reqs]
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= 1e-5


def test_named_prompts_match_sentence_transformers(minilm_folder, tmp_path):
    from sentence_transformers import SentenceTransformer

    prompts = {"query": "query: ", "document": "passage: "}
    for include_prompt in (True, False):
        folder = derived_folder(minilm_folder, tmp_path / f"p{include_prompt}", prompts=prompts,
                                pooling={"include_prompt": include_prompt})
        st = SentenceTransformer(str(folder), device="cpu")
        eng = Engine(EngineConfig(model_dir=str(folder)))
        for name in ("query", "document"):
            ref = st.encode(TEXTS[:6], prompt_name=name)
            assert cosine_rows(embed(eng, TEXTS[:6], prompt=name), ref).min() >= 0.9999


def test_dimensions_truncate_then_normalize(engine):
    full = embed(engine, TEXTS[:3], normalize=False)
    short = embed(engine, TEXTS[:3], dimensions=32)
    expected = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-6)
    assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize("mode", ["cls", "last", "mean"])
def test_pooling_ignores_empty_padding_sequences(mode):
    """A graph bucket's trailing empty sequences start at T: pooling must not index past the end."""
    import torch
    from pergola.outputs.pooling import pool

    hidden = torch.arange(15, dtype=torch.float32).view(5, 3)  # [T=5, H=3]
    cu = torch.tensor([0, 3, 5, 5, 5], dtype=torch.int32)  # 2 real sequences + 2 empty ones
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    out = pool(hidden, cu, seq_ids, mode)
    assert out.shape == (4, 3)
    expected = {"cls": hidden[[0, 3]], "last": hidden[[2, 4]], "mean": torch.stack([hidden[:3].mean(0), hidden[3:].mean(0)])}
    torch.testing.assert_close(out[:2], expected[mode])
