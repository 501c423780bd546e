"""Truncation-aware tokenization: a text far over the model's limit is tokenized only as far as
a covering prefix, with exactly the ids of tokenizing it whole and truncating."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pergola.config import EngineConfig
from pergola.hf_folder import load_model_spec
from pergola.tokenization import TextTokenizer

LONG = {
    "english": "The quick brown fox jumps over the lazy dog, again and again. " * 20_000,
    "chinese": "北京是中华人民共和国的首都，也是全国的政治和文化中心。" * 20_000,
    "chinese, no punctuation": "北京是中华人民共和国的首都也是全国的政治和文化中心" * 20_000,
    "arabic": "القاهرة هي عاصمة مصر وأكبر مدنها. " * 20_000,
    "no spaces": "a" * 1_000_000,
    "digits": "1234567890" * 100_000,
    "code": "def f(x):\n        return [y for y in range(x) if y % 3 == 0]\n\n" * 20_000,
    "whitespace runs": ("word" + " " * 37 + "\n\t") * 20_000,
    "emoji": "🚀🔥👩‍💻✨ mixed text " * 40_000,
    "one long word": "pneumonoultramicroscopicsilicovolcanoconiosis" * 20_000,
}


def tokenizers_or_skip(name: str, minilm_folder: Path, tmp_path_factory) -> TextTokenizer:
    if name == "bert":
        spec = load_model_spec(minilm_folder)
    else:
        from conftest import qwen3_folders_or_skip

        folders = qwen3_folders_or_skip(tmp_path_factory.mktemp("qwen3tok"), "tiny", "float32")
        spec = load_model_spec(folders["causal-last"])
    return TextTokenizer(spec, EngineConfig(model_dir=str(spec.path), max_text_chars=10_000_000,
                                            max_request_chars=20_000_000).text_limits())


@pytest.fixture(scope="module", params=["bert", "qwen3"])
def tok(request, minilm_folder, tmp_path_factory) -> TextTokenizer:
    return tokenizers_or_skip(request.param, minilm_folder, tmp_path_factory)


def whole_then_truncate(tok: TextTokenizer, text: str) -> list[int]:
    """The reference: tokenize everything, keep the model's maximum (what HF does)."""
    text = text.lower() if tok.spec.do_lower_case else text
    return tok._truncating.encode(text, add_special_tokens=True).ids


@pytest.mark.parametrize("kind", sorted(LONG))
def test_long_texts_get_the_ids_of_whole_tokenization(tok, kind):
    text = LONG[kind]
    enc = tok.encode([text, "short", text[:5000]])
    assert enc.input_ids[:enc.lengths[0]].tolist() == whole_then_truncate(tok, text)
    rest = enc.input_ids[enc.lengths[0] + enc.lengths[1]:].tolist()
    assert rest == whole_then_truncate(tok, text[:5000])


@pytest.mark.parametrize("kind", sorted(LONG))
def test_a_long_text_is_refused_without_truncation(tok, kind):
    from pergola.errors import RequestError

    if len(whole_then_truncate(tok, LONG[kind])) < tok.spec.max_seq_length:
        pytest.skip("this text is short in tokens for this vocabulary (one [UNK])")
    with pytest.raises(RequestError, match="has more than"):
        tok.encode([LONG[kind]], truncate=False)


def test_a_5_mb_text_costs_what_a_few_kb_do(tok, monkeypatch):
    """Counted in characters handed to the tokenizer, not timed: the prefix grows only when it
    must, and a 5 MB text of words needs about the first 8 characters per kept token."""
    seen: list[int] = []
    whole, truncating = tok._whole, tok._truncating

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
    monkeypatch.setattr(tok, "_truncating", Spy(truncating))
    text = "The quick brown fox jumps over the lazy dog. " * 112_000  # 5.0 MB
    t0 = time.perf_counter()
    tok.encode([text])
    took = time.perf_counter() - t0
    assert sum(seen) <= 2 * 8 * (tok.spec.max_seq_length + 1) + 2048, seen
    print(f"5 MB text: {sum(seen):,} characters tokenized in {took * 1000:.1f} ms")
