"""Architectures beyond BERT and Qwen3, FP32 on the CPU, against sentence-transformers / transformers.

Each folder is written the way Hugging Face writes it (`save_pretrained` of a randomly initialised
transformers model, every parameter perturbed so that a dropped bias or norm shows), with a small
tokenizer of the model's kind and the sentence-transformers files (pergola_testing). Embeddings
must match sentence-transformers (cosine >= 0.9999), reranker scores transformers' (<= 1e-4), and a
batch must equal its texts sent one by one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TEXTS, cosine_rows
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.heads import activate
from pergola.outputs.pooling import finish
from pergola.text.rerank import RerankTokenizer
from pergola.text.tokenization import TextTokenizer
from test_rerank import DOCS, QUERY  # the documents that test truncation and scripts

# A literal "<pad>" is tokenized as the padding id: RoBERTa-family positions skip it.
XLMR_TEXTS = [*TEXTS, "text with a literal <pad> token inside <pad> it"]


def engine_for(folder: Path, **overrides) -> Engine:
    return Engine(EngineConfig(model_dir=str(folder), dtype="float32", device="cpu", **overrides))


def embed(engine: Engine, texts: list[str], prompt: str | None = None) -> np.ndarray:
    enc = TextTokenizer(engine.spec).encode(texts, prompt_name=prompt)
    request = EncodeRequest(enc.input_ids, enc.lengths, enc.prompt_lengths)
    engine.validate(request)
    pooled = engine.encode([request])[0]
    return finish(pooled, 0, engine.spec.normalize)


def st_embed(folder: Path, texts: list[str], prompt: str | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return st.encode(texts, prompt_name=prompt, convert_to_numpy=True, batch_size=len(texts))


def assert_matches_sentence_transformers(engine: Engine, folder: Path, texts: list[str],
                                         prompt: str | None = None) -> np.ndarray:
    """Engine == sentence-transformers (cosine and values), and batched == one text at a time."""
    ours, reference = embed(engine, texts, prompt), st_embed(folder, texts, prompt)
    assert ours.shape == reference.shape
    assert cosine_rows(ours, reference).min() >= 0.9999
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    singles = np.concatenate([embed(engine, [t], prompt) for t in texts])
    assert cosine_rows(ours, singles).min() >= 0.99999
    return ours


def engine_scores(engine: Engine, query: str, docs: list[str]) -> np.ndarray:
    enc = RerankTokenizer(engine.spec).encode(query, docs)
    request = EncodeRequest(enc.input_ids, enc.lengths, token_types=enc.token_type_ids)
    engine.validate(request)  # as the server does: segment ids the model does not embed are refused
    return activate(engine.encode([request])[0], "sigmoid")[:, 0]  # as the adapter answers: sigmoid(logit)


def sequence_classification_scores(folder: Path, query: str, docs: list[str]) -> np.ndarray:
    """sigmoid(logit) of AutoModelForSequenceClassification, one pair at a time (no padding),
    truncating the document only, as pergola does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for doc in docs:
            feats = tok(query, doc, truncation="only_second", max_length=tok.model_max_length, return_tensors="pt")
            out.append(torch.sigmoid(model(**feats).logits[0, 0]).item())
    return np.array(out, dtype=np.float32)


# --- XLM-RoBERTa ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def xlmr_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pergola_testing import make_xlm_roberta_folder, make_xlm_roberta_reranker_folder

    root = tmp_path_factory.mktemp("xlm-roberta")
    return {"cls": make_xlm_roberta_folder(root / "cls", pooling="cls"),
            "mean": make_xlm_roberta_folder(root / "mean", pooling="mean", seed=1),
            "reranker": make_xlm_roberta_reranker_folder(root / "reranker", seed=2)}


def test_xlm_roberta_spec(xlmr_folders):
    spec = load_model_spec(xlmr_folders["cls"])
    assert (spec.architecture, spec.pooling, spec.normalize, spec.max_seq_length) == ("bert", "cls", True, 512)
    rerank = load_model_spec(xlmr_folders["reranker"])
    assert (rerank.task, rerank.pooling, rerank.max_seq_length) == ("rerank", "cls", 512)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_xlm_roberta_matches_sentence_transformers(xlmr_folders, pooling):
    folder = xlmr_folders[pooling]
    engine = engine_for(folder)
    assert engine.type_vocab_size == 1
    assert_matches_sentence_transformers(engine, folder, XLMR_TEXTS)


def test_xlm_roberta_positions_start_after_the_padding_index(xlmr_folders):
    """Sequences of 512 tokens (positions 2..513) are served; 513 are refused by the length check."""
    from pergola.text.errors import RequestError

    engine = engine_for(xlmr_folders["mean"])
    ids = np.full(512, 5, dtype=np.int64)
    ids[0], ids[-1] = 0, 2
    out = engine.encode([EncodeRequest(ids, np.array([512], dtype=np.int32))])[0]
    assert np.isfinite(out).all()
    with pytest.raises(RequestError, match="at most 512"):
        engine.validate(EncodeRequest(np.full(513, 5, dtype=np.int64), np.array([513], dtype=np.int32)))


def test_xlm_roberta_reranker_matches_transformers(xlmr_folders):
    folder = xlmr_folders["reranker"]
    engine = engine_for(folder)
    ours = engine_scores(engine, QUERY, DOCS)
    np.testing.assert_allclose(ours, sequence_classification_scores(folder, QUERY, DOCS), atol=1e-4, rtol=0)
    singles = np.array([engine_scores(engine, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(ours, singles, atol=1e-5, rtol=0)


def test_xlm_roberta_served_end_to_end(tmp_path, xlmr_folders):
    """`pergola serve` with an XLM-R embedder and an XLM-R reranker: through Triton (gRPC), the
    tokenizer model, the encoder and the ensembles give sentence-transformers' / transformers' numbers."""
    from conftest import start_serve
    from pergola_client import PergolaClient

    served = start_serve(tmp_path, f"xe={xlmr_folders['mean']}", "--model", f"xr={xlmr_folders['reranker']}")
    try:
        with PergolaClient(f"127.0.0.1:{served.grpc}") as client:
            vectors = client.embed(XLMR_TEXTS, model="xe")
            result = client.rerank(QUERY, DOCS, model="xr")
    finally:
        served.stop()
    assert cosine_rows(vectors, st_embed(xlmr_folders["mean"], XLMR_TEXTS)).min() >= 0.9999
    expected = sequence_classification_scores(xlmr_folders["reranker"], QUERY, DOCS)
    np.testing.assert_allclose(result.scores, expected, atol=1e-4, rtol=0)


# --- sentence-transformers Dense modules (any architecture) ---------------------------------------

def dense_modules(spec: list[tuple[int, int, bool, str]], seed: int) -> list:
    """sentence-transformers Dense modules (in, out, bias, activation) with seeded weights."""
    from pergola_testing import st_modules

    Dense = st_modules().Dense
    torch.manual_seed(seed)
    activations = {"identity": torch.nn.Identity, "tanh": torch.nn.Tanh}
    return [Dense(i, o, bias=b, activation_function=activations[a]()) for i, o, b, a in spec]


@pytest.fixture(scope="module")
def dense_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """EmbeddingGemma's pipeline (mean -> Dense 768->3072->768 without bias or activation ->
    Normalize) and LaBSE's (CLS -> Dense with bias and Tanh -> Normalize), on a tiny XLM-R."""
    from pergola_testing import make_xlm_roberta_folder

    root = tmp_path_factory.mktemp("dense")
    gemma_like = dense_modules([(64, 256, False, "identity"), (256, 48, False, "identity")], seed=3)
    labse_like = dense_modules([(64, 64, True, "tanh")], seed=4)
    return {"mean-identity": make_xlm_roberta_folder(root / "mean-identity", pooling="mean", seed=5,
                                                     dense=gemma_like),
            "cls-tanh": make_xlm_roberta_folder(root / "cls-tanh", pooling="cls", seed=6, dense=labse_like)}


@pytest.mark.parametrize("kind, width", [("mean-identity", 48), ("cls-tanh", 64)])
def test_dense_modules_match_sentence_transformers(dense_folders, kind, width):
    folder = dense_folders[kind]
    spec = load_model_spec(folder)
    assert spec.hidden_size == width and len(spec.dense) == (2 if kind == "mean-identity" else 1)
    out = assert_matches_sentence_transformers(engine_for(folder), folder, XLMR_TEXTS)
    assert out.shape == (len(XLMR_TEXTS), width)


def test_a_nonlinear_dense_after_mean_pooling_matches_sentence_transformers(tmp_path):
    """Tanh after mean pooling does not commute with the mean: the stack runs on pooled rows."""
    from pergola_testing import make_xlm_roberta_folder

    dense = dense_modules([(64, 32, True, "tanh")], seed=7)
    folder = make_xlm_roberta_folder(tmp_path / "mean-tanh", pooling="mean", seed=8, dense=dense)
    out = assert_matches_sentence_transformers(engine_for(folder), folder, XLMR_TEXTS)
    assert out.shape == (len(XLMR_TEXTS), 32)


# --- MPNet --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mpnet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pergola_testing import make_mpnet_folder

    return make_mpnet_folder(tmp_path_factory.mktemp("mpnet") / "mpnet", seed=7)


def test_mpnet_matches_sentence_transformers(mpnet_folder):
    spec = load_model_spec(mpnet_folder)
    assert (spec.architecture, spec.pooling, spec.normalize, spec.max_seq_length) == ("mpnet", "mean", True, 384)
    # TEXTS[1] is cut at 384 tokens: relative distances reach the logarithmic buckets (past 128).
    assert_matches_sentence_transformers(engine_for(mpnet_folder), mpnet_folder, XLMR_TEXTS)


# --- Qwen2 (gte-Qwen2) and Gemma3 (EmbeddingGemma): decoders with query prompts -------------------

@pytest.fixture(scope="module")
def decoder_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pergola_testing import make_gemma3_folder, make_qwen2_folder

    root = tmp_path_factory.mktemp("decoders")
    return {"qwen2": make_qwen2_folder(root / "qwen2", seed=8), "gemma3": make_gemma3_folder(root / "gemma3", seed=9)}


# (architecture, causal, pooling, normalize, embedding width, Dense modules) each folder must read as.
DECODER_SPECS = {"qwen2": ("qwen3", True, "last", True, 64, 0), "gemma3": ("gemma3", False, "mean", True, 64, 2)}


@pytest.mark.parametrize("prompt", [None, "query"])
@pytest.mark.parametrize("kind", ["qwen2", "gemma3"])
def test_decoder_matches_sentence_transformers(decoder_folders, kind, prompt):
    """gte-Qwen2: causal, last token, q/k/v biases, no q/k norm. EmbeddingGemma: bidirectional,
    Gemma norms and scaling, Dense after mean pooling, and texts of 1 to 300+ tokens against a
    16-token window, so the band and the ragged path both run."""
    folder = decoder_folders[kind]
    spec = load_model_spec(folder)
    assert (spec.architecture, spec.causal, spec.pooling, spec.normalize, spec.hidden_size, len(spec.dense)) == \
        DECODER_SPECS[kind]
    engine = engine_for(folder)
    assert hasattr(engine.runner.model.layers[0].self_attn, "q_norm") == (kind == "gemma3")
    assert_matches_sentence_transformers(engine, folder, TEXTS, prompt)


# --- ModernBERT -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modernbert_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pergola_testing import make_modernbert_folder, make_modernbert_reranker_folder

    root = tmp_path_factory.mktemp("modernbert")
    return {"embed": make_modernbert_folder(root / "embed", seed=10),
            "reranker": make_modernbert_reranker_folder(root / "reranker", seed=11)}


def test_modernbert_matches_sentence_transformers(modernbert_folders):
    """Texts of 1 to 400+ tokens against a 16-token local window (|q - k| <= 8): the band and the
    ragged path both run, and global layers see the whole text."""
    folder = modernbert_folders["embed"]
    spec = load_model_spec(folder)
    assert (spec.architecture, spec.pooling, spec.normalize, spec.max_seq_length) == ("modernbert", "cls", True, 8192)
    assert_matches_sentence_transformers(engine_for(folder), folder, TEXTS)


def test_modernbert_reranker_matches_transformers(modernbert_folders):
    folder = modernbert_folders["reranker"]
    spec = load_model_spec(folder)
    assert (spec.task, spec.pooling) == ("rerank", "mean")
    engine = engine_for(folder)
    ours = engine_scores(engine, QUERY, DOCS)
    np.testing.assert_allclose(ours, sequence_classification_scores(folder, QUERY, DOCS), atol=1e-4, rtol=0)
    singles = np.array([engine_scores(engine, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(ours, singles, atol=1e-5, rtol=0)


# --- Configs as transformers 4.x wrote them (the published folders) -------------------------------

def as_transformers4_config(cfg: dict, model_type: str) -> dict:
    """config.json in the 4.x layout of the published EmbeddingGemma / ModernBERT folders: RoPE
    bases as top-level keys instead of `rope_parameters`, ModernBERT's layer pattern as
    `global_attn_every_n_layers` instead of `layer_types`."""
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    params = cfg["rope_parameters"]
    if model_type == "gemma3_text":
        out.update(rope_theta=params["full_attention"]["rope_theta"],
                   rope_local_base_freq=params["sliding_attention"]["rope_theta"], rope_scaling=None)
    else:
        out.pop("layer_types")
        out.update(global_rope_theta=params["full_attention"]["rope_theta"],
                   local_rope_theta=params["sliding_attention"]["rope_theta"], global_attn_every_n_layers=3)
    return out


@pytest.mark.parametrize("kind", ["gemma3", "modernbert"])
def test_transformers4_configs_read_the_same(tmp_path, decoder_folders, modernbert_folders, kind):
    import json

    src = decoder_folders["gemma3"] if kind == "gemma3" else modernbert_folders["embed"]
    dst = tmp_path / kind
    dst.mkdir()
    for item in src.iterdir():
        if item.name != "config.json":
            (dst / item.name).symlink_to(item)
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] != cfg["rope_parameters"]["sliding_attention"]["rope_theta"]
    (dst / "config.json").write_text(json.dumps(as_transformers4_config(cfg, cfg["model_type"])))
    expected = embed(engine_for(src), TEXTS)
    np.testing.assert_allclose(embed(engine_for(dst), TEXTS), expected, atol=1e-6, rtol=0)


# --- RoBERTa ----------------------------------------------------------------------------------------

def test_roberta_matches_sentence_transformers(tmp_path):
    """RoBERTa: XLM-R's network (models/bert.py, positions after the padding index)."""
    from pergola_testing import make_xlm_roberta_folder

    folder = make_xlm_roberta_folder(tmp_path / "roberta", pooling="mean", seed=12, model_type="roberta")
    assert load_model_spec(folder).hf_config["model_type"] == "roberta"
    assert_matches_sentence_transformers(engine_for(folder), folder, XLMR_TEXTS)


# --- What is refused ------------------------------------------------------------------------------

def test_unsupported_folders_are_refused_by_name(tmp_path, xlmr_folders):
    import json
    import shutil

    from pergola.config.hf_folder import ModelFolderError

    folder = tmp_path / "t5"
    folder.mkdir()
    shutil.copy(xlmr_folders["cls"] / "tokenizer.json", folder / "tokenizer.json")
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5EncoderModel"]}))
    with pytest.raises(ModelFolderError, match=r"model_type 't5' is not supported; supported: .*'modernbert'"):
        load_model_spec(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "mpnet", "hidden_size": 64,
                                                    "architectures": ["MPNetForSequenceClassification"]}))
    with pytest.raises(ModelFolderError, match="mpnet is served as an embedder only; rerankers: .*'xlm-roberta'"):
        load_model_spec(folder)


def test_relative_position_embeddings_are_refused(tmp_path, xlmr_folders):
    """The folders carry the published "absolute" (vLLM reads it too); BERT's relative_key
    variants would be served with the wrong positions, so they are refused by name."""
    import json
    import shutil

    from pergola.config.hf_folder import ModelFolderError

    for name in ("cls", "reranker"):
        assert json.loads((xlmr_folders[name] / "config.json").read_text())["position_embedding_type"] == "absolute"
    folder = shutil.copytree(xlmr_folders["cls"], tmp_path / "relative")
    config = json.loads((folder / "config.json").read_text()) | {"position_embedding_type": "relative_key"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="position_embedding_type 'relative_key' is not supported"):
        load_model_spec(folder)


# --- Steps shaped like CUDA-graph buckets (the GPU path), on the CPU ------------------------------

class LoopAttention:
    """Reference ragged attention: one SDPA call per sequence of cu_seqlens (empty ones skipped)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        out = torch.zeros_like(q)
        cu = meta.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            if end > start:
                one = [x[start:end].transpose(0, 1) for x in (q, k, v)]  # [H, L, D]
                out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                    *one, is_causal=meta.causal, enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
        return out


def run_step(model, ids: np.ndarray, lengths: list[int], causal: bool, seqs: int = 0, tokens: int = 0) -> torch.Tensor:
    """The model's hidden states for one step. seqs/tokens > 0: padded as a CUDA-graph bucket is
    (engine/runner.StaticBuffers): padding tokens of id 0 and position 0 form one extra sequence,
    empty sequences fill up to `seqs`, and the longest sequence is taken to be `tokens`."""
    from pergola.engine.runner import host_inputs
    from pergola.layers.attention import AttentionMetadata

    n = len(ids)
    positions = host_inputs(np.array(lengths), None)[0]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    longest = max(lengths)
    if tokens:
        ids = np.concatenate([ids, np.zeros(tokens - n, np.int64)])
        positions = np.concatenate([positions, np.zeros(tokens - n, np.int64)])
        cu = np.concatenate([cu, np.full(seqs - len(lengths), tokens)])
        longest = tokens
    meta = AttentionMetadata(cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=longest, causal=causal)
    ids_t, pos_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64)
    with torch.inference_mode():
        return model(ids_t, pos_t, torch.zeros_like(ids_t), meta, LoopAttention())[:n]


@pytest.mark.parametrize("kind", ["xlm-roberta", "mpnet", "qwen2", "gemma3", "modernbert"])
def test_graph_bucket_steps_equal_real_steps(kind, xlmr_folders, mpnet_folder, decoder_folders, modernbert_folders):
    """A step padded to a bucket (more tokens and sequences, the longest sequence unknown) gives the
    real tokens the states of the unpadded step: the padded-grid paths (MPNet's bias, the sliding
    windows) bound their grid, skip empty sequences and keep padding apart. Lengths within the
    tiny windows (7, 5) run the sliding layers on the ragged kernel unpadded and on the band padded."""
    folder = {"xlm-roberta": xlmr_folders["mean"], "mpnet": mpnet_folder, "qwen2": decoder_folders["qwen2"],
              "gemma3": decoder_folders["gemma3"], "modernbert": modernbert_folders["embed"]}[kind]
    engine = engine_for(folder)
    model, causal = engine.runner.model, engine.spec.causal
    rng = np.random.default_rng(0)
    for lengths in ([7, 5], [30, 12, 1]):
        ids = rng.integers(3, engine.vocab_size, sum(lengths))
        real = run_step(model, ids, lengths, causal)
        bucket = run_step(model, ids, lengths, causal, seqs=len(lengths) + 3, tokens=64)
        torch.testing.assert_close(bucket, real, atol=1e-5, rtol=1e-5)


def test_an_unknown_hidden_act_is_refused_when_the_model_is_built():
    from pergola.config.hf_folder import ModelFolderError
    from pergola.models.bert import BertLayer

    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "hidden_act": "swish2"}
    with pytest.raises(ModelFolderError, match="hidden_act 'swish2'"):
        BertLayer(cfg)
