"""Qwen3 (tiny shape, seeded random weights, real tokenizer) against Hugging Face, FP32 on the CPU.

causal-last (Qwen3-Embedding layout) is checked against sentence-transformers on the folder;
bidirectional-mean (pplx-embed style) against transformers' Qwen3Model run with full attention,
since neither transformers nor sentence-transformers reads `use_bidirectional_attention`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TEXTS, cosine_rows, qwen3_folders_or_skip
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.pooling import finish
from pergola.text.tokenization import TextTokenizer
from pergola_testing import EOS_ID, QUERY_PROMPT


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return qwen3_folders_or_skip(tmp_path_factory.mktemp("qwen3"), "tiny", "float32")


@pytest.fixture(scope="module")
def engines(folders: dict[str, Path]) -> dict[str, Engine]:
    return {v: Engine(EngineConfig(model_dir=str(f), dtype="float32")) for v, f in folders.items()}


_TOKENIZERS: dict[Path, TextTokenizer] = {}  # per folder: loading the 151k-token vocabulary takes ~1 s


def embed(engine: Engine, texts: list[str], prompt: str | None = None) -> np.ndarray:
    if engine.spec.path not in _TOKENIZERS:
        _TOKENIZERS[engine.spec.path] = TextTokenizer(engine.spec)
    tok = _TOKENIZERS[engine.spec.path]
    enc = tok.encode(texts, prompt_name=prompt)
    pooled = engine.encode([EncodeRequest(enc.input_ids, enc.lengths, enc.prompt_lengths)])[0]
    return finish(pooled, 0, engine.spec.normalize)


def test_specs_read_the_variant(folders):
    last, mean = load_model_spec(folders["causal-last"]), load_model_spec(folders["bidirectional-mean"])
    assert (last.architecture, last.causal, last.pooling, last.normalize) == ("qwen3", True, "last", True)
    assert (mean.architecture, mean.causal, mean.pooling, mean.normalize) == ("qwen3", False, "mean", True)
    assert last.prompts == {"query": QUERY_PROMPT, "document": ""}
    assert load_model_spec(folders["bidirectional-mean"], causal=True).causal  # explicit override wins


def test_tokenizer_appends_eos_like_transformers(folders):
    from transformers import AutoTokenizer

    spec = load_model_spec(folders["causal-last"])
    enc = TextTokenizer(spec).encode(TEXTS)
    ends = np.cumsum(enc.lengths) - 1
    assert (enc.input_ids[ends] == EOS_ID).all()
    hf = AutoTokenizer.from_pretrained(str(folders["causal-last"]))
    ours = np.split(enc.input_ids, np.cumsum(enc.lengths)[:-1])
    for text, ids in zip(TEXTS, ours):
        assert ids.tolist() == hf(text)["input_ids"], text


@pytest.mark.parametrize("prompt", [None, "query"])
def test_causal_last_matches_sentence_transformers(folders, engines, prompt):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folders["causal-last"]), device="cpu")
    reference = st.encode(TEXTS, prompt_name=prompt, convert_to_numpy=True, batch_size=len(TEXTS))
    out = embed(engines["causal-last"], TEXTS, prompt)
    assert out.shape == reference.shape == (len(TEXTS), 64)
    assert cosine_rows(out, reference).min() >= 0.9999
    np.testing.assert_allclose(out, reference, atol=1e-5)


def _transformers_mean(folder: Path, texts: list[str], bidirectional: bool) -> np.ndarray:
    """transformers' Qwen3Model, one unpadded text at a time, mean pooled and normalised.

    Full attention: a 4-D additive float mask of zeros [1, 1, L, L] replaces the causal mask
    (transformers uses a prepared 4-D mask as is, in eager and SDPA alike).
    """
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok(text)["input_ids"]])
            length = ids.shape[1]
            mask = torch.zeros(1, 1, length, length) if bidirectional else None
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[0]  # [L, hidden]
            rows.append(hidden.mean(0).numpy())
    return finish(np.stack(rows), 0, True)


def test_bidirectional_mean_matches_transformers(folders, engines):
    reference = _transformers_mean(folders["bidirectional-mean"], TEXTS, bidirectional=True)
    causal = _transformers_mean(folders["bidirectional-mean"], TEXTS, bidirectional=False)
    # The reference really is bidirectional: every text has >= 2 tokens (text + EOS), so the
    # first token's state, and with it the mean, changes when it may look ahead.
    assert (np.abs(reference - causal).max(axis=1) > 1e-3).all()
    out = embed(engines["bidirectional-mean"], TEXTS)
    assert cosine_rows(out, reference).min() >= 0.9999
    np.testing.assert_allclose(out, reference, atol=1e-5)
    assert cosine_rows(out, causal).min() < 0.9999


@pytest.mark.parametrize("variant", ["causal-last", "bidirectional-mean"])
def test_batched_equals_single(engines, variant):
    batched = embed(engines[variant], TEXTS)
    for i, text in enumerate(TEXTS):
        assert np.abs(embed(engines[variant], [text])[0] - batched[i]).max() <= 1e-5, text


def test_loads_causal_lm_checkpoints(folders, engines, tmp_path):
    """`model.`-prefixed names and an lm_head (Qwen3ForCausalLM layout) load to the same model."""
    from safetensors.torch import load_file, save_file

    src = folders["causal-last"]
    for item in src.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).symlink_to(item)
    weights = {f"model.{k}": v for k, v in load_file(str(src / "model.safetensors")).items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model.safetensors"))
    other = Engine(EngineConfig(model_dir=str(tmp_path), dtype="float32"))
    np.testing.assert_array_equal(embed(other, TEXTS[:4]), embed(engines["causal-last"], TEXTS[:4]))


def test_folded_norms_equal_the_norms(folders, engines, tmp_path):
    """Norm gains folded into the q/k/v and gate/up weights (the default) give the unfolded
    model's answer, with gains that are not 1 (HF's init, the seeded folders') so a gain folded
    into the wrong rows or columns, or applied twice, shows."""
    from safetensors.torch import load_file, save_file

    src = folders["causal-last"]
    dst = tmp_path / "gains"
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "model.safetensors":
            (dst / item.name).symlink_to(item)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = w + 0.5 * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, str(dst / "model.safetensors"))

    folded = Engine(EngineConfig(model_dir=str(dst), dtype="float32"))
    plain = Engine(EngineConfig(model_dir=str(dst), dtype="float32", fold_norms=False))
    assert all(layer.folded for layer in folded.runner.model.layers)
    assert not any(layer.folded for layer in plain.runner.model.layers)
    a, b = embed(folded, TEXTS), embed(plain, TEXTS)
    assert np.abs(a - b).max() <= 1e-5
    assert cosine_rows(a, embed(engines["causal-last"], TEXTS)).min() < 0.999  # the gains matter
