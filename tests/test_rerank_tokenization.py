"""Rerank tokenization (issue 4) against Hugging Face, plus the reranker test folders. CPU only.

cross-encoder: ids and token types must equal transformers' `tokenizer(query, doc,
truncation="only_second", max_length=...)`. qwen3-reranker: ids must equal the official
Qwen3-Reranker reference construction (prefix ids + body ids truncated to
max_length - len(prefix) - len(suffix) + suffix ids).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TEXTS
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.text.errors import RequestError
from pergola.text.rerank import (
    QWEN3_RERANKER_INSTRUCTION,
    QWEN3_RERANKER_PREFIX,
    QWEN3_RERANKER_SUFFIX,
    RerankEncoded,
    RerankTokenizer,
)
from pergola_testing import EOS_ID, TokenizerUnavailable, make_cross_encoder_folder, make_qwen3_reranker_folder

QUERY = "What is the capital of France?"
# The embedding tests' texts, with the long one doubled so that pairs are cut at 512 tokens.
DOCUMENTS = [TEXTS[0], TEXTS[1] * 2, *TEXTS[2:]]
QUERIES = [QUERY, "Quelle est la capitale de la France ? 🇫🇷", "首都はどこですか", "x"]


def split(enc: RerankEncoded, field: str = "input_ids") -> list[list[int]]:
    ends = np.cumsum(enc.lengths)
    return [a.tolist() for a in np.split(getattr(enc, field), ends[:-1])]


@pytest.fixture(scope="module")
def ce_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_cross_encoder_folder(tmp_path_factory.mktemp("ce") / "ce", seed=0)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return make_qwen3_reranker_folder(tmp_path_factory.mktemp("qr") / "qr", "tiny", seed=0)
    except TokenizerUnavailable as e:
        pytest.skip(f"the real Qwen3 tokenizer is not available: {e}")


def sixteen(folder: Path) -> EngineConfig:
    """Limits of a server that takes at most 16 documents per request."""
    return EngineConfig(model_dir=str(folder), max_documents=16)


@pytest.fixture(scope="module")
def ce_tok(ce_folder: Path) -> RerankTokenizer:
    return RerankTokenizer(load_model_spec(ce_folder), "cross-encoder", sixteen(ce_folder))


@pytest.fixture(scope="module")
def qwen_tok(qwen_folder: Path) -> RerankTokenizer:
    return RerankTokenizer(load_model_spec(qwen_folder, task="rerank"), "qwen3-reranker", sixteen(qwen_folder))


_QWEN_TOKENIZERS: dict[tuple, RerankTokenizer] = {}  # loading the 151k vocabulary takes ~1 s


def qwen_tokenizer(folder: Path, max_length: int, instruction: str | None = None) -> RerankTokenizer:
    key = (folder, max_length, instruction)
    if key not in _QWEN_TOKENIZERS:
        spec = load_model_spec(folder, task="rerank")
        _QWEN_TOKENIZERS[key] = RerankTokenizer(spec, "qwen3-reranker", sixteen(folder),
                                                instruction=instruction, max_length=max_length)
    return _QWEN_TOKENIZERS[key]


@pytest.fixture(scope="module")
def hf_ce_tokenizer(ce_folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ce_folder))


@pytest.fixture(scope="module")
def hf_qwen_tokenizer(qwen_folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_folder))


# --- cross-encoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("max_length", [512, 24])
@pytest.mark.parametrize("query", QUERIES)
def test_cross_encoder_matches_transformers(ce_folder, hf_ce_tokenizer, query, max_length):
    tok = RerankTokenizer(load_model_spec(ce_folder), "cross-encoder", sixteen(ce_folder), max_length=max_length)
    enc = tok.encode(query, DOCUMENTS)
    ref = hf_ce_tokenizer([query] * len(DOCUMENTS), DOCUMENTS, truncation="only_second", max_length=max_length)
    assert split(enc) == ref["input_ids"]
    assert split(enc, "token_type_ids") == ref["token_type_ids"]
    assert enc.input_ids.dtype == np.int64 and enc.token_type_ids.dtype == np.int64
    assert enc.lengths.dtype == np.int32 and int(enc.lengths.max()) <= max_length
    if max_length == 512:
        assert enc.lengths[1] == 512  # the long document was cut


def test_cross_encoder_keeps_the_query(ce_tok, hf_ce_tokenizer):
    assert ce_tok.max_length == 512  # tokenizer_config model_max_length of the folder
    query = "capital city " * 100  # 200 tokens: longest_first would cut it, only_second must not
    enc = ce_tok.encode(query, [DOCUMENTS[1]])
    q = hf_ce_tokenizer(query, add_special_tokens=False)["input_ids"]
    ids = split(enc)[0]
    assert len(ids) == 512 and ids[1:1 + len(q)] == q and ids[1 + len(q)] == hf_ce_tokenizer.sep_token_id


def test_cross_encoder_untruncated_limit(ce_tok):
    short = ce_tok.encode(QUERY, DOCUMENTS[:1], truncate=False)
    assert split(short) == split(ce_tok.encode(QUERY, DOCUMENTS[:1]))
    with pytest.raises(RequestError, match=r"DOCUMENTS\[1\] with the query is \d+ tokens, over this model's "
                                           r"limit of 512; .*TRUNCATE=true"):
        ce_tok.encode(QUERY, DOCUMENTS[:2], truncate=False)


# --- qwen3-reranker --------------------------------------------------------------------------


def qwen3_reference(hf_tok, query: str, docs: list[str], max_length: int,
                    instruction: str = QWEN3_RERANKER_INSTRUCTION) -> list[list[int]]:
    """The official Qwen3-Reranker `process_inputs` (without the padding)."""
    prefix_tokens = hf_tok.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix_tokens = hf_tok.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}" for doc in docs]
    inputs = hf_tok(pairs, padding=False, truncation="longest_first", return_attention_mask=False,
                    max_length=max_length - len(prefix_tokens) - len(suffix_tokens))
    return [prefix_tokens + ele + suffix_tokens for ele in inputs["input_ids"]]


def test_qwen3_matches_reference_default_length(qwen_tok, hf_qwen_tokenizer):
    assert qwen_tok.max_length == 8192
    docs = DOCUMENTS + ["Paris is the capital and most populous city of France. " * 900]  # > 8192 tokens
    enc = qwen_tok.encode(QUERY, docs)
    got = split(enc)
    assert got == qwen3_reference(hf_qwen_tokenizer, QUERY, docs, 8192)
    assert enc.lengths[-1] == 8192 and enc.lengths[0] < 100
    assert not enc.token_type_ids.any()
    suffix = hf_qwen_tokenizer.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    for ids in got:  # no EOS after the assistant suffix
        assert ids[-len(suffix):] == suffix and EOS_ID not in ids


@pytest.mark.parametrize("query", QUERIES)
def test_qwen3_matches_reference_short_limit(qwen_folder, hf_qwen_tokenizer, query):
    tok = qwen_tokenizer(qwen_folder, 160)
    enc = tok.encode(query, DOCUMENTS)
    assert split(enc) == qwen3_reference(hf_qwen_tokenizer, query, DOCUMENTS, 160)
    assert enc.lengths[1] == 160
    # the cut fell in the document: the instruction and the query survive whole
    text = hf_qwen_tokenizer.decode(split(enc)[1])
    assert f"<Query>: {query}\n<Document>: Paris is" in text


def test_qwen3_instruction_and_answer_ids(qwen_folder, hf_qwen_tokenizer):
    tok = qwen_tokenizer(qwen_folder, 200, instruction="Find the city")
    enc = tok.encode(QUERY, DOCUMENTS)
    assert split(enc) == qwen3_reference(hf_qwen_tokenizer, QUERY, DOCUMENTS, 200, instruction="Find the city")
    assert tok.answer_ids.yes == hf_qwen_tokenizer.convert_tokens_to_ids("yes")
    assert tok.answer_ids.no == hf_qwen_tokenizer.convert_tokens_to_ids("no")
    assert tok.answer_ids.yes != tok.answer_ids.no


def test_qwen3_untruncated_limit(qwen_folder):
    tok = qwen_tokenizer(qwen_folder, 160)
    assert split(tok.encode(QUERY, DOCUMENTS[:1], truncate=False)) == split(tok.encode(QUERY, DOCUMENTS[:1]))
    with pytest.raises(RequestError, match=r"DOCUMENTS\[1\] with the query is \d+ tokens, over this model's "
                                           r"limit of 160"):
        tok.encode(QUERY, DOCUMENTS[:2], truncate=False)


# --- errors ----------------------------------------------------------------------------------

ERRORS = [
    (QUERY, [], r"DOCUMENTS is empty; send at least one document"),
    ("", ["doc"], r"QUERY is an empty string; every query needs content"),
    (QUERY, ["doc", ""], r"DOCUMENTS\[1\] is an empty string; every document needs content"),
    (QUERY, ["doc"] * 17, r"17 documents in one request; the limit is 16 \(max_documents\): split"),
]


@pytest.mark.parametrize("kind", ["cross-encoder", "qwen3-reranker"])
@pytest.mark.parametrize("query,docs,message", ERRORS)
def test_request_errors(request, kind, query, docs, message):
    tok = request.getfixturevalue("ce_tok" if kind == "cross-encoder" else "qwen_tok")
    for truncate in (True, False):
        with pytest.raises(RequestError, match=message):
            tok.encode(query, docs, truncate=truncate)


@pytest.mark.parametrize("kind", ["cross-encoder", "qwen3-reranker"])
def test_query_too_long(request, kind):
    folder = request.getfixturevalue("ce_folder" if kind == "cross-encoder" else "qwen_folder")
    tok = RerankTokenizer(load_model_spec(folder, task="rerank"), kind,
                          EngineConfig(model_dir=str(folder), max_query_chars=100_000))
    words = 600 if kind == "cross-encoder" else 9000
    query = "capital " * words
    for truncate in (True, False):
        with pytest.raises(RequestError, match=r"QUERY is too long: .* leaving no room for the document; "
                                               r"shorten the query"):
            tok.encode(query, ["doc"], truncate=truncate)


@pytest.mark.parametrize("query,docs,message", [
    ("q" * 33, ["doc"], r"QUERY is 33 characters; the limit is 32 characters \(max_query_chars"),
    ("q", ["d" * 65], r"DOCUMENTS\[0\] is 65 characters; the limit is 64 characters \(max_text_chars"),
    ("q" * 30, ["d" * 60, "d" * 60], r"this request's text is 150 characters; the limit is 128 characters "
                                      r"\(max_request_chars"),
    ("q", ["d" * 300], r"DOCUMENTS\[0\] is 300 bytes; the limit is 64 characters"),  # refused undecoded
])
def test_character_limits_are_checked_before_tokenization(ce_folder, query, docs, message):
    config = EngineConfig(model_dir=str(ce_folder), max_query_chars=32, max_text_chars=64, max_request_chars=128)
    tok = RerankTokenizer(load_model_spec(ce_folder), "cross-encoder", config)
    with pytest.raises(RequestError, match=message):
        tok.encode(query, [d.encode() for d in docs])


def test_query_at_the_edge_of_the_limit(ce_folder, hf_ce_tokenizer):
    tok = RerankTokenizer(load_model_spec(ce_folder), "cross-encoder", max_length=16)
    query = "one two three four five six seven eight nine ten eleven twelve"  # 12 tokens + 3 special
    assert len(hf_ce_tokenizer(query, add_special_tokens=False)["input_ids"]) == 12
    enc = tok.encode(query, ["a long document that is cut"])
    assert split(enc)[0] == hf_ce_tokenizer(query, "a long document that is cut", truncation="only_second",
                                            max_length=16)["input_ids"]
    with pytest.raises(RequestError, match="QUERY is too long"):
        tok.encode(query + " thirteen", ["doc"])


# --- the folders load in Hugging Face and sentence-transformers -------------------------------


def test_cross_encoder_folder_loads(ce_folder, ce_tok):
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    spec = load_model_spec(ce_folder)
    assert spec.task == "rerank" and spec.architecture == "bert" and spec.max_seq_length == 512
    model = AutoModelForSequenceClassification.from_pretrained(str(ce_folder)).eval()
    assert model.config.num_labels == 1
    pairs = [(QUERY, d) for d in DOCUMENTS[:4]]
    enc = ce_tok.encode(QUERY, [d for _, d in pairs])
    with torch.no_grad():
        logits = torch.cat([
            model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([tt])).logits[:, 0]
            for ids, tt in zip(split(enc), split(enc, "token_type_ids"))
        ]).numpy()
    ce = CrossEncoder(str(ce_folder), device="cpu")
    assert isinstance(ce.activation_fn, torch.nn.Sigmoid)
    scores = ce.predict(pairs, batch_size=4)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-logits)), rtol=1e-4, atol=1e-5)
    assert np.ptp(logits) > 1e-3  # random weights still tell the documents apart


def test_qwen3_reranker_folder_loads(qwen_folder, qwen_tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen_folder), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    enc = qwen_tok.encode(QUERY, DOCUMENTS[:2])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([split(enc)[0]])).logits[0, -1]
    pair = out[list(qwen_tok.answer_ids)]
    assert torch.isfinite(pair).all()
    spec = load_model_spec(qwen_folder, task="rerank")
    assert spec.architecture == "qwen3" and spec.causal


@pytest.mark.parametrize("kind", ["cross-encoder", "qwen3-reranker"])
@pytest.mark.parametrize("document", [  # over twice the longest covering prefix (Qwen3: 65 / 130 / 130 KB)
    "The quick brown fox jumps over the lazy dog. " * 6_000,
    "北京是中华人民共和国的首都也是全国的政治和文化中心" * 12_000,
    "z" * 300_000,
])
def test_long_documents_are_cut_before_tokenization_with_the_same_ids(request, monkeypatch, kind, document):
    """Only a covering prefix of a long document is tokenized; the pair ids equal those of the
    whole document tokenized and cut (the reference: the same tokenizer with prefixes off)."""
    import pergola.text.tokenization as tokenization

    folder = request.getfixturevalue("ce_folder" if kind == "cross-encoder" else "qwen_folder")
    tok = RerankTokenizer(load_model_spec(folder, task="rerank"), kind,
                          EngineConfig(model_dir=str(folder), max_text_chars=2_000_000, max_request_chars=4_000_000))
    ours = tok.encode(QUERY, [document, "short one"])
    monkeypatch.setattr(tokenization, "covering_prefix", lambda whole, text, tokens: text)
    whole = tok.encode(QUERY, [document, "short one"])
    assert ours.input_ids.tolist() == whole.input_ids.tolist()
    assert ours.lengths.tolist() == whole.lengths.tolist()
    assert ours.token_type_ids.tolist() == whole.token_type_ids.tolist()
