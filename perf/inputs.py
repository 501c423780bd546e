"""Benchmark inputs cut from real text: the Python documentation that every CPython ships
(`pydoc_data.topics`, ~0.7 MB of English prose and code), tokenized with the model's own
tokenizer and sliced into distinct windows of exact token lengths.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def special_tokens(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(prefix, suffix) ids the model's post-processor wraps around every text."""
    with_special = tok.encode("hello").ids
    content = tok.encode("hello", add_special_tokens=False).ids
    for i in range(len(with_special) - len(content) + 1):
        if with_special[i:i + len(content)] == content:
            return with_special[:i], with_special[i + len(content):]
    raise ValueError("cannot locate the content tokens inside the post-processed encoding")


class TokenWindows:
    """Distinct token windows of an exact length (specials included), from the corpus."""

    def __init__(self, tokenizer_file: str | Path) -> None:
        self.tok = Tokenizer.from_file(str(tokenizer_file))
        self.tok.no_truncation()
        self.tok.no_padding()
        self.stream = np.asarray(self.tok.encode(corpus_text(), add_special_tokens=False).ids, dtype=np.int64)
        self.prefix, self.suffix = special_tokens(self.tok)

    def ids(self, length: int, count: int, seed: int = 0) -> list[np.ndarray]:
        body = length - len(self.prefix) - len(self.suffix)
        if body < 1 or body > self.stream.size:
            raise ValueError(f"length {length} does not fit the corpus ({self.stream.size} tokens)")
        starts = np.random.default_rng(seed).integers(0, self.stream.size - body, size=count)
        pre, suf = np.asarray(self.prefix, np.int64), np.asarray(self.suffix, np.int64)
        return [np.concatenate([pre, self.stream[s:s + body], suf]) for s in starts]

    def texts(self, length: int, count: int, seed: int = 0) -> list[str]:
        """Texts that tokenize to about `length` tokens (decoded windows)."""
        body = length - len(self.prefix) - len(self.suffix)
        starts = np.random.default_rng(seed).integers(0, self.stream.size - body, size=count)
        return [self.tok.decode(self.stream[s:s + body].tolist()) for s in starts]
