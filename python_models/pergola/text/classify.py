"""Sequence classification (`...ForSequenceClassification` folders with several labels): texts, or
(text, text_pair) pairs, to flat token ids, and what a request asks of its answer.

Each input is tokenized as transformers' `tokenizer(text, text_pair, truncation=True)` makes it
(and TEI's /predict): the tokenizer's template ([CLS] a [SEP] b [SEP] for BERT, <s> a </s></s> b
</s> for XLM-R) and, for a pair over the limit, "longest_first" truncation (the longer side loses
a token at a time). TRUNCATE_MODE END cuts the end (transformers' default), START the start
(truncation_side="left"), NONE refuses an input over the model's limit. The probabilities are the
head's logits through softmax or sigmoid (pergola.outputs.heads), the logits themselves with RAW_SCORES.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from pergola.config.hf_folder import ModelSpec
from pergola.text.errors import RequestError, StringLimits, read_strings
from pergola.text.tokenization import truncate_mode


@dataclass(frozen=True)
class ClassifyEncoded:
    input_ids: np.ndarray  # [num_tokens] int64: every input's ids, concatenated
    lengths: np.ndarray  # [n] int32: tokens per input
    token_type_ids: np.ndarray  # [num_tokens] int64: 0 for the text, 1 for its pair (models with segment ids)
    truncated: np.ndarray  # [n] bool: the input was cut


@dataclass(frozen=True)
class ClassifyOptions:
    """What a classify request asks of its answer: RAW_SCORES, the logits instead of probabilities."""

    raw_scores: bool = False


class ClassifyTokenizer:
    """TEXT [n] (and TEXT_PAIR [n], each text's second sequence) -> flat token ids."""

    def __init__(self, spec: ModelSpec, limits: StringLimits) -> None:
        self.spec = spec
        self.limits = limits
        self.max_length = spec.max_seq_length
        self._cutters: dict[str, Tokenizer] = {}  # truncation side -> a tokenizer cutting there
        for mode, side in (("END", "right"), ("START", "left")):
            tok = Tokenizer.from_file(str(spec.tokenizer_file))
            tok.no_padding()
            tok.enable_truncation(self.max_length, strategy="longest_first", direction=side)
            self._cutters[mode] = tok

    def read_request(self, texts: list[str | bytes], pairs: list[str | bytes] | None) -> list[str | tuple[str, str]]:
        """The inputs decoded and checked against the limits (a pair's two texts count together)."""
        firsts = read_strings(texts, "TEXT", "text", self.limits)
        if pairs is None:
            return list(firsts)
        if len(pairs) != len(firsts):
            raise RequestError(f"TEXT_PAIR has {len(pairs)} strings for {len(firsts)} in TEXT; send one second "
                               "text per text (or leave TEXT_PAIR out)")
        seconds = read_strings(pairs, "TEXT_PAIR", "text", self.limits, used_chars=sum(map(len, firsts)))
        return list(zip(firsts, seconds))

    def encode(self, texts: list[str | bytes], pairs: list[str | bytes] | None = None,
               truncate: bool | str = True) -> ClassifyEncoded:
        """truncate: a mode (NONE | START | END) or its BOOL form."""
        inputs = self.read_request(texts, pairs)
        mode = truncate_mode(truncate)
        encodings = self._cutters["START" if mode == "START" else "END"].encode_batch(inputs)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings))
        # What truncation cut off comes back as `overflowing` (nothing for an input that fits).
        truncated = np.fromiter((bool(e.overflowing) for e in encodings), dtype=bool, count=len(encodings))
        if mode == "NONE" and truncated.any():
            i = int(np.flatnonzero(truncated)[0])
            raise RequestError(f"TEXT[{i}] has more than {self.max_length} tokens, over this model's limit of "
                               f"{self.max_length}; shorten it or allow truncation (TRUNCATE_MODE=END or START, "
                               "or TRUNCATE=true)")
        input_ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int64, count=int(lengths.sum()))
        if self.spec.type_vocab_size > 1:
            types = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int64, count=len(input_ids))
        else:  # XLM-R, ModernBERT: no segment embeddings, and their tokenizers return none
            types = np.zeros(len(input_ids), dtype=np.int64)
        return ClassifyEncoded(input_ids, lengths, types, truncated)
