"""Reranking: engine and server against sentence-transformers' CrossEncoder / transformers (FP32, CPU).

Cross-encoder: seeded random weights in the MiniLM cross-encoder shape on the real MiniLM
tokenizer; Qwen3-Reranker: tiny Qwen3 causal LM on the real Qwen3 tokenizer, scored as the
official reference does (softmax over the "no"/"yes" logits at the last position).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import MAX_TEXTS, TEST_DEVICE
from pergola.config.engine import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.heads import activate
from pergola.text.rerank import RerankTokenizer
from tritonclient.utils import InferenceServerException

QUERY = "what is the capital of France?"
DOCS = [
    "Paris is the capital and most populous city of France.",
    "Berlin is the capital of Germany. " * 3,
    "北京是中华人民共和国的首都。",
    "🚀 rockets and emoji",
    "def capital(country):\n    return CAPITALS[country]",
    "trains " * 700,  # over the limit: the document is cut, the query kept
]
MAX_DIFF = 1e-4 if TEST_DEVICE == "cpu" else 1e-2


@functools.cache
def engine(folder, task: str | None) -> tuple[Engine, RerankTokenizer]:
    """One engine and tokenizer per folder (the Qwen3 vocabulary takes ~1 s to load): batches and
    single documents go through the same ones, as in a server."""
    eng = Engine(EngineConfig(model_dir=str(folder), task=task))
    return eng, RerankTokenizer(eng.spec)


@functools.cache
def cross_encoder(folder):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(folder), device="cpu")


def engine_scores(folder, task: str | None, query: str, docs: list[str], raw: bool = False) -> np.ndarray:
    """What the server answers: sigmoid of the engine's logits, or the logits (`raw`)."""
    eng, tok = engine(folder, task)
    enc = tok.encode(query, docs)
    logits = eng.encode([EncodeRequest(enc.input_ids, enc.lengths, token_types=enc.token_type_ids)])[0]
    return activate(logits, "sigmoid", raw)[:, 0]


def cross_encoder_logits(folder, query: str, docs: list[str]) -> np.ndarray:
    """The classifier's logits in CrossEncoder, with the document-first truncation pergola uses
    (only_second)."""
    ce = cross_encoder(folder)
    tok = ce.tokenizer
    feats = tok([query] * len(docs), docs, truncation="only_second", max_length=512, padding=True,
                return_tensors="pt")
    with torch.no_grad():
        return ce.model(**feats).logits[:, 0].numpy()


def cross_encoder_reference(folder, query: str, docs: list[str]) -> np.ndarray:
    """CrossEncoder.predict: its default activation, sigmoid, of the logits."""
    return torch.sigmoid(torch.from_numpy(cross_encoder_logits(folder, query, docs))).numpy()


def qwen3_reranker_reference(folder, query: str, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(P(yes) as the official reference computes it, logit(yes) - logit(no))."""
    from transformers import AutoModelForCausalLM

    tok = RerankTokenizer(engine(folder, "rerank")[0].spec, "qwen3-reranker")
    enc = tok.encode(query, docs)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    out, raw, start = [], [], 0
    with torch.no_grad():
        for n in enc.lengths:
            logits = model(input_ids=torch.tensor(enc.input_ids[start:start + n])[None]).logits[0, -1]
            no, yes = logits[list(tok.answer_ids)]
            out.append(torch.softmax(torch.stack([no, yes]), 0)[1].item())
            raw.append((yes - no).item())
            start += n
    return np.array(out, dtype=np.float32), np.array(raw, dtype=np.float32)


def test_cross_encoder_matches_sentence_transformers(rerank_folders):
    folder = rerank_folders["cross-encoder"]
    ours = engine_scores(folder, None, QUERY, DOCS)
    np.testing.assert_allclose(ours, cross_encoder_reference(folder, QUERY, DOCS), atol=1e-4, rtol=0)
    np.testing.assert_allclose(engine_scores(folder, None, QUERY, DOCS, raw=True),
                               cross_encoder_logits(folder, QUERY, DOCS), atol=1e-4, rtol=0)
    singles = np.array([engine_scores(folder, None, QUERY, [d])[0] for d in DOCS])
    np.testing.assert_allclose(ours, singles, atol=1e-5, rtol=0)


def test_qwen3_reranker_matches_transformers(rerank_folders):
    if "qwen3-reranker" not in rerank_folders:
        pytest.skip("the real Qwen3 tokenizer is not available")
    folder = rerank_folders["qwen3-reranker"]
    scores, logits = qwen3_reranker_reference(folder, QUERY, DOCS)
    np.testing.assert_allclose(engine_scores(folder, "rerank", QUERY, DOCS), scores, atol=1e-4, rtol=0)
    np.testing.assert_allclose(engine_scores(folder, "rerank", QUERY, DOCS, raw=True), logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model", ["rerank", "qr"])
def test_server_scores_in_input_order(server, rerank_folders, model):
    from pergola_client import PergolaClient

    if model == "qr" and "qwen3-reranker" not in rerank_folders:
        pytest.skip("the real Qwen3 tokenizer is not available")
    folder, task = (rerank_folders["cross-encoder"], None) if model == "rerank" else (rerank_folders["qwen3-reranker"], "rerank")
    expected = engine_scores(folder, task, QUERY, DOCS)
    with PergolaClient(server.grpc_url) as client:
        result = client.rerank(QUERY, DOCS, model=model)
        raw = client.rerank(QUERY, DOCS, top_n=2, model=model, raw_scores=True)
        top = client.rerank(QUERY, DOCS, top_n=2, model=model)
        single = np.array([client.rerank(QUERY, [d], model=model).scores[0] for d in DOCS])
    assert result.scores.shape == (len(DOCS),) and result.scores.dtype == np.float32
    np.testing.assert_allclose(result.scores, expected, atol=MAX_DIFF, rtol=0)
    assert result.indices.tolist() == np.argsort(-result.scores, kind="stable").tolist()
    assert top.indices.tolist() == result.indices[:2].tolist()
    np.testing.assert_allclose(raw.scores, engine_scores(folder, task, QUERY, DOCS, raw=True), atol=MAX_DIFF, rtol=0)
    assert raw.indices.tolist() == top.indices.tolist()
    np.testing.assert_allclose(single, result.scores, atol=MAX_DIFF, rtol=0)


def _rerank_raw(server, query: list, docs: list, **options):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, data, dtype in (("QUERY", np.array([q.encode() for q in query], dtype=object), "BYTES"),
                              ("DOCUMENTS", np.array([d.encode() for d in docs], dtype=object), "BYTES"),
                              *options.values()):
        t = grpcclient.InferInput(name, list(data.shape), dtype)
        t.set_data_from_numpy(data)
        inputs.append(t)
    return c.infer("rerank", inputs)


@pytest.mark.parametrize("case", ["no documents", "empty query", "too many documents", "too long, truncation off",
                                  "empty document"])
def test_rerank_errors(server, case):
    query, docs, options, message = {
        "no documents": ([QUERY], [], {}, "DOCUMENTS"),
        "empty query": ([""], DOCS[:1], {}, "QUERY"),
        "too many documents": ([QUERY], ["d"] * (MAX_TEXTS + 1), {}, str(MAX_TEXTS)),
        "too long, truncation off": ([QUERY], ["word " * 600], {
            "t": ("TRUNCATE", np.array([False]), "BOOL")}, "512"),
        "empty document": ([QUERY], ["ok", ""], {}, "DOCUMENTS[1]"),
    }[case]
    with pytest.raises(InferenceServerException) as err:
        _rerank_raw(server, query, docs, **options)
    assert message in str(err.value), str(err.value)
    assert "INVALID_ARG" in str(err.value) or "StatusCode.INVALID_ARGUMENT" in str(err.value)
    assert _rerank_raw(server, [QUERY], DOCS[:2]).as_numpy("SCORE").shape == (2,)
