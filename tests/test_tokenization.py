"""Truncation-aware tokenization: a text far over the model's limit is tokenized only as far as
a covering prefix (END) or suffix (START), with exactly the ids of tokenizing it whole and
truncating as Hugging Face does, and a TRUNCATED flag that says so."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TEXTS
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.text.rerank import RerankTokenizer
from pergola.text.tokenization import TextTokenizer, truncate_mode
from tokenizers import Tokenizer

# 50-124 KB each: 8 to 2,000 times either model's limit in tokens (where a text is not one giant
# word) and over 3 times the longest covering window either tokenizer needs (16 KB), so the prefix
# or suffix grows as it must and stays short of the whole text; the reference tokenizes it whole.
LONG = {
    "english": "The quick brown fox jumps over the lazy dog, again and again. " * 2_000,
    "chinese": "北京是中华人民共和国的首都，也是全国的政治和文化中心。" * 2_000,
    "chinese, no punctuation": "北京是中华人民共和国的首都也是全国的政治和文化中心" * 2_000,
    "arabic": "القاهرة هي عاصمة مصر وأكبر مدنها. " * 2_000,
    "no spaces": "a" * 100_000,
    "digits": "1234567890" * 10_000,
    "code": "def f(x):\n        return [y for y in range(x) if y % 3 == 0]\n\n" * 2_000,
    "whitespace runs": ("word" + " " * 37 + "\n\t") * 2_000,
    "emoji": "🚀🔥👩‍💻✨ mixed text " * 4_000,
    "one long word": "pneumonoultramicroscopicsilicovolcanoconiosis" * 2_000,
}


def tokenizers_or_skip(name: str, minilm_folder: Path, tmp_path_factory) -> TextTokenizer:
    if name == "bert":
        spec = load_model_spec(minilm_folder)
    else:
        from pergola_testing import TokenizerUnavailable, make_qwen3_folder

        try:  # one variant: both share the tokenizer
            spec = load_model_spec(make_qwen3_folder(tmp_path_factory.mktemp("qwen3tok") / "causal-last", "tiny"))
        except TokenizerUnavailable as e:
            pytest.skip(f"the real Qwen3 tokenizer is not available: {e}")
    return TextTokenizer(spec, EngineConfig(model_dir=str(spec.path), max_text_chars=10_000_000,
                                            max_request_chars=20_000_000).text_limits())


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def tok(request, minilm_folder, tmp_path_factory) -> TextTokenizer:
    return tokenizers_or_skip(request.param, minilm_folder, tmp_path_factory)


_REFERENCES: dict[tuple, Tokenizer] = {}


def hf_tokenizer(tok: TextTokenizer, limit: int | None = None, direction: str = "right") -> Tokenizer:
    """The folder's tokenizer as Hugging Face truncates: to `limit` tokens, special ones included."""
    key = (tok.spec.tokenizer_file, limit, direction)
    if key not in _REFERENCES:
        ref = Tokenizer.from_file(str(tok.spec.tokenizer_file))
        ref.no_padding()
        if limit is None:
            ref.no_truncation()
        else:
            ref.enable_truncation(limit, direction=direction)
        _REFERENCES[key] = ref
    return _REFERENCES[key]


@functools.lru_cache(maxsize=64)
def reference(tok: TextTokenizer, text: str, limit: int | None = None, mode: str = "END") -> tuple[list[int], bool]:
    """Tokenize everything, keep `limit` tokens (the model's maximum) from the start (END) or the
    end (START), as Hugging Face does: (ids, whether it cut any)."""
    text = text.lower() if tok.spec.do_lower_case else text
    ref = hf_tokenizer(tok, limit or tok.spec.max_seq_length, "left" if mode == "START" else "right")
    enc = ref.encode(text, add_special_tokens=True)
    return enc.ids, bool(enc.overflowing)


def whole_then_truncate(tok: TextTokenizer, text: str, limit: int | None = None, mode: str = "END") -> list[int]:
    return reference(tok, text, limit, mode)[0]


def split(enc) -> list[list[int]]:
    return [a.tolist() for a in np.split(enc.input_ids, np.cumsum(enc.lengths)[:-1])]


@pytest.mark.parametrize("mode", ["END", "START"])
@pytest.mark.parametrize("kind", sorted(LONG))
def test_long_texts_get_the_ids_of_whole_tokenization(tok, kind, mode):
    text = LONG[kind]
    enc = tok.encode([text, "short", text[:5000]], truncate=mode)
    expected = [reference(tok, t, mode=mode) for t in (text, "short", text[:5000])]
    assert split(enc) == [ids for ids, _ in expected]
    assert enc.truncated.tolist() == [cut for _, cut in expected]


@pytest.mark.parametrize("mode", ["END", "START"])
@pytest.mark.parametrize("limit", [5, 40, 300])
def test_max_tokens_truncates_to_the_lower_limit(tok, mode, limit):
    """MAX_TOKENS cuts to min(model limit, it), from either end; the flag is exact at the edge."""
    texts = [TEXTS[1], TEXTS[0], LONG["chinese"][:3000], LONG["code"][:20_000]]
    edge = hf_tokenizer(tok).encode(texts[1].lower() if tok.spec.do_lower_case else texts[1]).ids
    texts.append(texts[1])
    enc = tok.encode(texts[:-1], truncate=mode, max_tokens=limit)
    expected = [reference(tok, t, min(limit, tok.spec.max_seq_length), mode) for t in texts[:-1]]
    assert split(enc) == [ids for ids, _ in expected]
    assert enc.truncated.tolist() == [cut for _, cut in expected]
    exact = tok.encode([texts[1]], truncate=mode, max_tokens=len(edge))  # exactly at the limit: not cut
    assert split(exact) == [edge] and not exact.truncated[0]
    assert tok.encode([texts[1]], truncate=mode, max_tokens=len(edge) - 1).truncated[0]


def test_start_keeps_the_prompt(tok):
    """START cuts the text's start but never the prompt: the prompt's own number of tokens from
    the front of prompt + text tokenized whole, then its end; wrapped by HF's post-processor."""
    from tokenizers import Encoding

    prompt = "Represent this sentence for searching relevant passages: "
    tok.spec.prompts["test-prompt"] = prompt
    try:
        limit = 24
        enc = tok.encode([TEXTS[1], "short"], prompt_name="test-prompt", truncate="START", max_tokens=limit)
    finally:
        del tok.spec.prompts["test-prompt"]
    joined, prompt = prompt + TEXTS[1], prompt.lower() if tok.spec.do_lower_case else prompt
    ref = hf_tokenizer(tok, None)
    head_len = len(ref.encode(prompt, add_special_tokens=False).ids)
    head = ref.encode(joined.lower() if tok.spec.do_lower_case else joined, add_special_tokens=False)
    tail = ref.encode(joined.lower() if tok.spec.do_lower_case else joined, add_special_tokens=False)
    head.truncate(head_len)
    tail.truncate(limit - ref.num_special_tokens_to_add(is_pair=False) - head_len, direction="left")
    expected = ref.post_process(Encoding.merge([head, tail], growing_offsets=True)).ids
    assert split(enc)[0] == expected and len(expected) == limit
    assert enc.truncated.tolist() == [True, False]


@pytest.mark.parametrize("kind", sorted(LONG))
def test_a_long_text_is_refused_without_truncation(tok, kind):
    from pergola.text.errors import RequestError

    if len(whole_then_truncate(tok, LONG[kind])) < tok.spec.max_seq_length:
        pytest.skip("this text is short in tokens for this vocabulary (one [UNK])")
    with pytest.raises(RequestError, match="has more than"):
        tok.encode([LONG[kind]], truncate=False)
    with pytest.raises(RequestError, match="has more than"):
        tok.encode([LONG[kind]], truncate="NONE")


def test_none_refuses_over_max_tokens_and_names_the_limit(tok):
    from pergola.text.errors import RequestError

    assert not tok.encode([TEXTS[0]], truncate="NONE", max_tokens=10**6).truncated.any()
    with pytest.raises(RequestError, match=r"TEXT\[1\] has more than 6 tokens, over this request's limit of 6 "
                                           r"\(MAX_TOKENS\)"):
        tok.encode(["a", TEXTS[1]], truncate="NONE", max_tokens=6)
    added = tok.template.added  # the special tokens alone: no room for text
    assert added >= 1
    with pytest.raises(RequestError, match=rf"MAX_TOKENS={added} leaves no room for text"):
        tok.encode(["a"], max_tokens=added)
    assert tok.encode(["a"], max_tokens=added + 1).lengths.tolist() == [added + 1]
    with pytest.raises(RequestError, match=r"MAX_TOKENS=-1 must be positive"):
        tok.encode(["a"], max_tokens=-1)


@pytest.mark.parametrize("value,expected", [(True, "END"), (False, "NONE"), ("start", "START"), ("END", "END"),
                                            ("None", "NONE"), (None, "END")])
def test_truncate_modes_and_their_bool_form(value, expected):
    assert truncate_mode(value) == expected


def test_an_unknown_truncate_mode_is_refused():
    from pergola.text.errors import RequestError

    with pytest.raises(RequestError, match=r"TRUNCATE_MODE='LEFT' is not a truncation mode; send NONE"):
        truncate_mode("LEFT")


@pytest.mark.parametrize("mode", ["END", "START"])
def test_a_5_mb_text_costs_what_a_few_kb_do(tok, monkeypatch, mode):
    """Counted in characters handed to the tokenizer, not timed: the prefix (END) or suffix
    (START) grows only when it must, and a 5 MB text of words needs about 8 characters per kept
    token."""
    seen: list[int] = []
    whole = tok._whole

    class Spy:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner

        def encode(self, text, *a, **k):
            seen.append(len(text))
            return self.inner.encode(text, *a, **k)

        def encode_batch(self, texts, *a, **k):
            seen.extend(len(t) if isinstance(t, str) else sum(map(len, t)) for t in texts)
            return self.inner.encode_batch(texts, *a, **k)

    monkeypatch.setattr(tok, "_whole", Spy(whole))
    text = "The quick brown fox jumps over the lazy dog. " * 112_000  # 5.0 MB
    t0 = time.perf_counter()
    tok.encode([text], truncate=mode)
    took = time.perf_counter() - t0
    assert sum(seen) <= 2 * 8 * (tok.spec.max_seq_length + 1) + 2048, seen
    print(f"5 MB text, {mode}: {sum(seen):,} characters tokenized in {took * 1000:.1f} ms")


# --- rerank: truncation modes, a document's token limit, a request's instruction -----------------

RERANK_QUERY = "what is the capital of France?"
RERANK_DOCS = [TEXTS[1] * 3, "a short document", LONG["english"][:200_000], LONG["chinese"][:100_000]]


@pytest.fixture(scope="module")
def cross_encoder(rerank_folders):
    from transformers import AutoTokenizer

    folder = rerank_folders["cross-encoder"]
    return RerankTokenizer(load_model_spec(folder)), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("mode", ["END", "START"])
@pytest.mark.parametrize("max_document_tokens", [None, 7])
def test_cross_encoder_modes_match_transformers(cross_encoder, mode, max_document_tokens):
    """END / START cut the document's end / start ("only_second", transformers' truncation_side);
    MAX_DOCUMENT_TOKENS keeps at most that many of a document's tokens."""
    tok, hf = cross_encoder
    enc = tok.encode(RERANK_QUERY, RERANK_DOCS, truncate=mode, max_document_tokens=max_document_tokens)
    added = hf.num_special_tokens_to_add(pair=True)
    query_len = len(hf(RERANK_QUERY, add_special_tokens=False)["input_ids"])
    max_length = tok.max_length if max_document_tokens is None else query_len + added + max_document_tokens
    hf.truncation_side = "left" if mode == "START" else "right"
    try:
        ref = hf([RERANK_QUERY] * len(RERANK_DOCS), RERANK_DOCS, truncation="only_second", max_length=max_length)
    finally:
        hf.truncation_side = "right"
    assert split(enc) == ref["input_ids"]
    types = np.split(enc.token_type_ids, np.cumsum(enc.lengths)[:-1])
    assert [t.tolist() for t in types] == ref["token_type_ids"]
    room = max_length - added - query_len
    assert enc.truncated.tolist() == [len(hf(d, add_special_tokens=False)["input_ids"]) > room for d in RERANK_DOCS]
    assert enc.truncated[0] and not enc.truncated[1]


def test_cross_encoder_none_and_instruction_are_refused(cross_encoder):
    from pergola.text.errors import RequestError

    tok, _ = cross_encoder
    with pytest.raises(RequestError, match=r"DOCUMENTS\[0\] has more than 7 tokens, over this request's limit "
                                           r"of 7 \(MAX_DOCUMENT_TOKENS\)"):
        tok.encode(RERANK_QUERY, RERANK_DOCS, truncate="NONE", max_document_tokens=7)
    with pytest.raises(RequestError, match="INSTRUCTION applies to Qwen3-Reranker models"):
        tok.encode(RERANK_QUERY, RERANK_DOCS[:1], instruction="Find the city")


@pytest.fixture(scope="module")
def qwen3_reranker(rerank_folders):
    from transformers import AutoTokenizer

    if "qwen3-reranker" not in rerank_folders:
        pytest.skip("the real Qwen3 tokenizer is not available")
    folder = rerank_folders["qwen3-reranker"]
    spec = load_model_spec(folder, task="rerank")
    return RerankTokenizer(spec, max_length=120), AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("mode", ["END", "START"])
@pytest.mark.parametrize("instruction", [None, "Find the passage that names the city"])
def test_qwen3_reranker_modes_and_instruction(qwen3_reranker, mode, instruction):
    """The official prompt with this request's instruction; END cuts the body's end (the
    reference's truncation), START keeps the instruction and query and the document's end."""
    from pergola.text.rerank import QWEN3_RERANKER_INSTRUCTION, QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX

    tok, hf = qwen3_reranker
    enc = tok.encode(RERANK_QUERY, RERANK_DOCS, truncate=mode, instruction=instruction)
    prefix = hf.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = hf.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    budget = 120 - len(prefix) - len(suffix)
    instruction = instruction or QWEN3_RERANKER_INSTRUCTION
    head = len(hf(f"<Instruct>: {instruction}\n<Query>: {RERANK_QUERY}\n<Document>:")["input_ids"])
    expected, cut = [], []
    for doc in RERANK_DOCS:
        body = hf(f"<Instruct>: {instruction}\n<Query>: {RERANK_QUERY}\n<Document>: {doc}")["input_ids"]
        kept = body[:budget] if mode == "END" else body[:head] + body[len(body) - (budget - head):]
        expected.append(prefix + (body if len(body) <= budget else kept) + suffix)
        cut.append(len(body) > budget)
    assert split(enc) == expected
    assert enc.truncated.tolist() == cut == [True, False, True, True]
