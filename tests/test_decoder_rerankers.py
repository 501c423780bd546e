"""Decoder rerankers and classifiers, FP32 on the CPU, against transformers.

* mxbai-rerank-v2 (Qwen2ForCausalLM): the official package's prompt, scored on the "0"/"1" logits
  of the last token; served with `--task rerank`, or without it where a sentence-transformers
  LogitScore module names the answer tokens.
* Qwen2/Qwen3ForSequenceClassification: last-token pooling -> `score` (no bias); one label is a
  reranker (the tokenizer's pair template), several a classifier.

Folders are `save_pretrained` of randomly initialised transformers models in tiny Qwen shapes
(every parameter perturbed), with a byte-level BPE tokenizer trained here that, like Qwen's, adds
no special tokens of its own and knows <|im_start|> / <|im_end|>. Scores must equal transformers'
(<= 1e-4), a batch its documents sent one by one, and the server the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import ModelFolderError, load_model_spec
from pergola.config.reranker import answer_ids, reranker_kind
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.heads import activate
from pergola.text.rerank import MXBAI_PREFIX, MXBAI_SEP, MXBAI_SUFFIX, MXBAI_TASK, RerankTokenizer
from test_rerank import DOCS, QUERY  # documents in several scripts, the last one over the limit

MAX_LENGTH = 512
SHAPES = {
    # Small enough for CI on a CPU (GQA 2:1).
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Exactly mixedbread-ai/mxbai-rerank-base-v2 (Qwen2.5-0.5B) but its vocabulary.
    "mxbai-base-v2": dict(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                          intermediate_size=4864, max_position_embeddings=32768, rope_theta=1000000.0,
                          rms_norm_eps=1e-6),
}
LABELS = ("negative", "neutral", "positive")
TEXTS = ["I loved every minute of it.", "北京是中国的首都。", "🚀 rockets and emoji", "words " * 700]


# Qwen2's pre-tokenizer split (its tokenizer.json, and transformers' Qwen2Tokenizer): digits one by one.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def save_tokenizer(out: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer laid out as Qwen2's (NFC, its split pattern, byte-level, Qwen's
    chat tokens, no post-processor tokens), trained on a small corpus; returns its vocabulary."""
    from pergola_testing import TOKENIZER_CORPUS
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((TOKENIZER_CORPUS + [MXBAI_PREFIX, MXBAI_TASK]) * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            padding_side="left", model_max_length=MAX_LENGTH).save_pretrained(str(out))
    return tok.get_vocab()


def make_folder(out: Path, kind: str, seed: int, num_labels: int = 1, tied: bool = True,
                logit_score: bool = False, shape: str = "tiny") -> Path:
    """kind: "qwen2-lm" (Qwen2ForCausalLM, mxbai-rerank-v2's layout), "qwen2-cls" / "qwen3-cls"
    (ForSequenceClassification with `num_labels`). logit_score: sentence-transformers CrossEncoder
    files scoring the "1"/"0" logits (modules.json Transformer -> LogitScore)."""
    from pergola_testing import _save_hf_model, perturb_
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen3Config,
        Qwen3ForSequenceClassification,
    )

    out.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(out)
    extra = dict(vocab_size=len(vocab), pad_token_id=vocab["<|endoftext|>"], tie_word_embeddings=tied)
    if kind == "qwen3-cls":
        config = Qwen3Config(**SHAPES[shape], head_dim=16, **extra)
    else:
        config = Qwen2Config(**SHAPES[shape], use_sliding_window=False, **extra)
    if kind != "qwen2-lm":
        config.num_labels = num_labels
        if num_labels > 1:
            config.id2label = dict(enumerate(LABELS))
            config.label2id = {name: i for i, name in enumerate(LABELS)}
    model_class = {"qwen2-lm": Qwen2ForCausalLM, "qwen2-cls": Qwen2ForSequenceClassification,
                   "qwen3-cls": Qwen3ForSequenceClassification}[kind]
    torch.manual_seed(seed)
    _save_hf_model(perturb_(model_class(config), seed), out, torch.float32)
    if logit_score:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_LogitScore",
                    "type": "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"}]
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_LogitScore").mkdir()
        (out / "1_LogitScore" / "config.json").write_text(
            json.dumps({"true_token_id": vocab["1"], "false_token_id": vocab["0"]}))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder-rerankers")
    return {"mxbai": make_folder(root / "mxbai", "qwen2-lm", seed=11),
            "mxbai-st": make_folder(root / "mxbai-st", "qwen2-lm", seed=12, tied=False, logit_score=True),
            "qwen2-rerank": make_folder(root / "qwen2-rerank", "qwen2-cls", seed=13),
            "qwen3-rerank": make_folder(root / "qwen3-rerank", "qwen3-cls", seed=14),
            "qwen3-classify": make_folder(root / "qwen3-classify", "qwen3-cls", seed=15, num_labels=3)}


def engine_for(folder: Path, task: str | None = None, **options) -> Engine:
    return Engine(EngineConfig(model_dir=str(folder), dtype="float32", device="cpu", task=task, **options))


def engine_logits(engine: Engine, query: str, docs: list[str], instruction: str | None = None) -> np.ndarray:
    enc = RerankTokenizer(engine.spec).encode(query, docs, instruction=instruction)
    request = EncodeRequest(enc.input_ids, enc.lengths, token_types=enc.token_type_ids)
    engine.validate(request)
    return engine.encode([request])[0][:, 0]


def official_mxbai_ids(folder: Path, query: str, doc: str, instruction: str | None = None) -> list[int]:
    """The ids mixedbread's `mxbai_rerank` package builds for one pair under its length limit
    (each part tokenized on its own, no special tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    q = (f"instruction: {instruction}{MXBAI_SEP}" if instruction else "") + f"query: {query}"
    return (ids(MXBAI_PREFIX) + ids(q) + ids(MXBAI_SEP) + ids(f"document: {doc}") + ids(MXBAI_SEP) + ids(MXBAI_TASK)
            + ids(MXBAI_SUFFIX))


def causal_lm_logits(folder: Path, sequences: list[np.ndarray]) -> np.ndarray:
    """logit("1") - logit("0") at the last position of AutoModelForCausalLM, one sequence at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    yes, no = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("0")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]).logits[0, -1]
            out.append((logits[yes] - logits[no]).item())
    return np.array(out, dtype=np.float32)


def split(enc) -> list[np.ndarray]:
    return np.split(enc.input_ids, np.cumsum(enc.lengths)[:-1])


def sequence_classification_logits(folder: Path, firsts: list[str], seconds: list[str] | None = None) -> np.ndarray:
    """AutoModelForSequenceClassification's logits, one input at a time (no padding), truncating the
    second text only, as pergola does."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for i, first in enumerate(firsts):
            feats = tok(first, seconds[i] if seconds else None, truncation="only_second" if seconds else True,
                        max_length=MAX_LENGTH, return_tensors="pt")
            rows.append(model(**feats).logits[0].numpy())
    return np.stack(rows)


# --- what the folder says ---------------------------------------------------------------------

def test_specs(folders):
    plain = load_model_spec(folders["mxbai"])
    assert plain.task == "embed"  # a Qwen2ForCausalLM folder alone may be an embedder (gte-Qwen2)
    lm = load_model_spec(folders["mxbai"], task="rerank")
    assert (reranker_kind(lm), lm.pooling, lm.causal) == ("mxbai-rerank-v2", "last", True)
    st = load_model_spec(folders["mxbai-st"])  # its LogitScore module says rerank, and on which tokens
    assert st.task == "rerank" and reranker_kind(st) == "mxbai-rerank-v2"
    vocab = json.loads((folders["mxbai-st"] / "tokenizer.json").read_text())["model"]["vocab"]
    assert answer_ids(st) == (vocab["0"], vocab["1"])
    for name in ("qwen2-rerank", "qwen3-rerank"):
        spec = load_model_spec(folders[name])
        assert (spec.task, reranker_kind(spec), spec.pooling, spec.causal) == ("rerank", "cross-encoder", "last", True)
    cls = load_model_spec(folders["qwen3-classify"])
    assert (cls.task, cls.pooling, cls.num_labels) == ("classify", "last", 3)
    # a converted yes/no reranker (score head) takes the prompt it was converted from
    converted = load_model_spec(folders["qwen3-rerank"], rerank_prompt="qwen3-reranker")
    assert reranker_kind(converted) == "qwen3-reranker"
    with pytest.raises(ModelFolderError, match="does not fit"):
        load_model_spec(folders["mxbai"], task="rerank", rerank_prompt="cross-encoder")
    with pytest.raises(ModelFolderError, match="not one of"):
        load_model_spec(folders["mxbai"], task="rerank", rerank_prompt="bge-gemma")
    with pytest.raises(ModelFolderError, match="several labels"):
        load_model_spec(folders["mxbai"], task="classify")
    with pytest.raises(ValueError, match="rerank_prompt must be one of"):
        EngineConfig(model_dir=str(folders["mxbai"]), rerank_prompt="yes-no")


def test_mxbai_ids_equal_the_official_package(folders):
    folder = folders["mxbai"]
    tok = RerankTokenizer(load_model_spec(folder, task="rerank"))
    for instruction in (None, "Find the passage that answers the question!"):
        enc = tok.encode(QUERY, DOCS, instruction=instruction)
        assert enc.truncated.tolist() == [False] * (len(DOCS) - 1) + [True]
        assert enc.lengths.max() <= MAX_LENGTH
        for doc, ids in zip(DOCS[:-1], split(enc)):
            assert ids.tolist() == official_mxbai_ids(folder, QUERY, doc, instruction), doc
        # the cut document keeps its head and the prompt's end
        assert split(enc)[-1][-len(tok.suffix_ids):].tolist() == tok.suffix_ids.tolist()


@pytest.mark.parametrize("name", ["mxbai", "mxbai-st"])
def test_mxbai_scores_equal_transformers(folders, name):
    folder = folders[name]
    engine = engine_for(folder, "rerank" if name == "mxbai" else None)
    enc = RerankTokenizer(engine.spec).encode(QUERY, DOCS)
    expected = causal_lm_logits(folder, split(enc))
    ours = engine_logits(engine, QUERY, DOCS)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(activate(ours[:, None], "sigmoid")[:, 0], torch.sigmoid(torch.from_numpy(expected)),
                               atol=1e-5, rtol=0)  # P("1") = softmax(["0", "1"] logits)["1"]
    singles = np.array([engine_logits(engine, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(ours, singles, atol=1e-5, rtol=0)
    instructed = engine_logits(engine, QUERY, DOCS[:2], instruction="Rank French sources first")
    official = [official_mxbai_ids(folder, QUERY, d, "Rank French sources first") for d in DOCS[:2]]
    np.testing.assert_allclose(instructed, causal_lm_logits(folder, official), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-rerank", "qwen3-rerank"])
def test_sequence_classification_reranker_equals_transformers(folders, name):
    folder = folders[name]
    engine = engine_for(folder)
    ours = engine_logits(engine, QUERY, DOCS)
    np.testing.assert_allclose(ours, sequence_classification_logits(folder, [QUERY] * len(DOCS), DOCS)[:, 0],
                               atol=1e-4, rtol=0)
    singles = np.array([engine_logits(engine, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(ours, singles, atol=1e-5, rtol=0)


def test_converted_reranker_takes_the_yes_no_prompt(folders):
    """A ForSequenceClassification head over a yes/no prompt (tomaarsen/Qwen3-Reranker-*-seq-cls):
    the prompt's ids (`--rerank-prompt`), scored by `score`."""
    folder = folders["qwen3-rerank"]
    engine = engine_for(folder, rerank_prompt="mxbai-rerank-v2")
    enc = RerankTokenizer(engine.spec).encode(QUERY, DOCS[:3])
    assert [ids.tolist() for ids in split(enc)] == [official_mxbai_ids(folder, QUERY, d) for d in DOCS[:3]]
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [model(input_ids=torch.as_tensor(ids)[None]).logits[0, 0].item() for ids in split(enc)]
    np.testing.assert_allclose(engine_logits(engine, QUERY, DOCS[:3]), expected, atol=1e-4, rtol=0)


def test_decoder_classifier_equals_transformers(folders):
    from pergola.text.classify import ClassifyTokenizer

    folder = folders["qwen3-classify"]
    engine = engine_for(folder)
    enc = ClassifyTokenizer(engine.spec, EngineConfig(model_dir=str(folder)).text_limits()).encode(TEXTS)
    logits = engine.encode([EncodeRequest(enc.input_ids, enc.lengths)])[0]
    np.testing.assert_allclose(logits, sequence_classification_logits(folder, TEXTS), atol=1e-4, rtol=0)


# --- through the server -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(folders, tmp_path_factory: pytest.TempPathFactory):
    from conftest import start_serve

    process = start_serve(tmp_path_factory.mktemp("decoder-serve"), f"mxbai={folders['mxbai-st']}",
                          "--model", f"qwen2rr={folders['qwen2-rerank']}",
                          "--model", f"qwen3cls={folders['qwen3-classify']}")
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize("name,folder", [("mxbai", "mxbai-st"), ("qwen2rr", "qwen2-rerank")])
def test_server_rerank(served, folders, name, folder):
    from pergola_client import PergolaClient

    expected = engine_logits(engine_for(folders[folder]), QUERY, DOCS)
    with PergolaClient(f"127.0.0.1:{served.grpc}") as client:
        raw = client.rerank(QUERY, DOCS, model=name, raw_scores=True)
        result = client.rerank(QUERY, DOCS, model=name)
        single = np.array([client.rerank(QUERY, [d], model=name).scores[0] for d in DOCS])
    np.testing.assert_allclose(raw.scores, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(result.scores, activate(expected[:, None], "sigmoid")[:, 0], atol=1e-5, rtol=0)
    assert result.indices.tolist() == np.argsort(-result.scores, kind="stable").tolist()
    np.testing.assert_allclose(single, result.scores, atol=1e-5, rtol=0)


def test_server_classify(served, folders):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    text = grpcclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
    result = client.infer("qwen3cls", [text])
    logits = sequence_classification_logits(folders["qwen3-classify"], TEXTS)
    assert [s.decode() for s in result.as_numpy("LABELS")] == list(LABELS)
    np.testing.assert_allclose(result.as_numpy("PROBS"), torch.softmax(torch.from_numpy(logits), 1).numpy(),
                               atol=1e-4, rtol=0)


# --- GPU: the published shape in BF16 -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen2-lm", "qwen2-cls"])
def test_bf16_published_shape_matches_fp32_transformers(tmp_path, kind):
    """mxbai-rerank-base-v2's shape (and a Qwen2ForSequenceClassification of it), BF16 on the GPU
    through eager warm-up, graph capture and replay, against transformers FP32: raw scores within
    0.1 (24 BF16 layers; a score is the small difference of two large logits), sigmoid scores
    within 2.5e-2, the order of scores 0.2 apart kept; one by one within 0.1 of batched."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    folder = make_folder(tmp_path / kind, kind, seed=21, shape="mxbai-base-v2")
    engine = Engine(EngineConfig(model_dir=str(folder), device="cuda", task="rerank"))
    assert engine.runner.dtype == torch.bfloat16
    enc = RerankTokenizer(engine.spec).encode(QUERY, DOCS)
    auto = AutoModelForCausalLM if kind == "qwen2-lm" else AutoModelForSequenceClassification
    model = auto.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    yes, no = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("0")
    expected = []
    with torch.no_grad():
        for ids in split(enc):
            logits = model(input_ids=torch.as_tensor(ids)[None].cuda()).logits
            expected.append((logits[0, -1, yes] - logits[0, -1, no]).item() if kind == "qwen2-lm"
                            else logits[0, 0].item())
    del model
    torch.cuda.empty_cache()
    expected = np.array(expected, dtype=np.float32)
    request = EncodeRequest(enc.input_ids, enc.lengths, token_types=enc.token_type_ids)
    modes = []
    for _ in range(3):  # eager warm-up, capture, replay
        ours = engine.encode([request])[0][:, 0]
        modes.append(engine.runner.last_mode)
        np.testing.assert_allclose(ours, expected, atol=0.1, rtol=0)
        np.testing.assert_allclose(activate(ours[:, None], "sigmoid")[:, 0],
                                   torch.sigmoid(torch.from_numpy(expected)).numpy(), atol=2.5e-2, rtol=0)
        apart = np.abs(expected[:, None] - expected[None, :]) > 0.2
        assert (np.sign(ours[:, None] - ours[None, :]) == np.sign(expected[:, None] - expected[None, :]))[apart].all()
    singles = np.array([engine_logits(engine, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(singles, ours, atol=0.1, rtol=0)  # other step shapes, other BF16 roundings
    print(kind, modes, "max |bf16 - fp32|", float(np.abs(ours - expected).max()), "spread",
          float(expected.max() - expected.min()), "max |single - batched|", float(np.abs(singles - ours).max()))
