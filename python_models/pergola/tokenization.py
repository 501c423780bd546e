"""The gateway's CPU work: prompts, batch tokenization, truncation, token counts.

Tokenization is batched through HF `tokenizers` (Rust, parallel across texts); the only Python
loop is the gather of each encoding's ids into one flat array, which the encoder needs anyway.

Truncation-aware: a text far longer than the model's limit is not tokenized whole. Only a prefix
that certainly yields the kept tokens is (`covering_prefix`), so a 5 MB text costs what a few kB
do, with the same ids as tokenizing everything and truncating.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding, Tokenizer

from pergola.config import EngineConfig
from pergola.errors import RequestError, StringLimits, quote, read_strings
from pergola.hf_folder import ModelSpec

# A first prefix of CHARS_PER_TOKEN characters per kept token covers them in nearly every
# language (English ~4.5 characters a token, CJK ~1, code with long whitespace tokens more);
# when it does not, the prefix doubles.
CHARS_PER_TOKEN = 8


def _first_unsafe_token(enc: Encoding) -> int:
    """Index of the first token that may differ from the whole text's tokens at the same place.

    The tokens of a prefix equal those of the whole text except in its last pre-tokens
    ("words"): normalisers work per character, pre-tokenizers split by rules that look at most
    one character ahead, and the model (WordPiece, BPE, Unigram) works inside one pre-token. So
    the last two words of the prefix are unsafe (the last may be cut, the one before may be
    split differently next to it), everything before them is the whole text's.
    """
    words = [w for w in enc.word_ids if w is not None]
    if not words:
        return 0
    unsafe = max(words) - 1
    return next((i for i, w in enumerate(enc.word_ids) if w is not None and w >= unsafe), len(enc.ids))


def covering_prefix(whole: Tokenizer, text: str, tokens: int) -> str:
    """The shortest tried prefix of `text` whose first `tokens` tokens are the whole text's.

    `whole` tokenizes without truncation or special tokens' effect on words. One giant word (a
    long run without spaces or punctuation in a byte-level BPE vocabulary) has no safe boundary;
    there two prefixes of different lengths must agree on the first `tokens` ids (BPE merges reach
    back from a cut only through chains of overlapping merges, far shorter than the prefix).
    """
    chars = max(512, tokens * CHARS_PER_TOKEN)
    previous: list[int] | None = None
    while chars < len(text):
        enc = whole.encode(text[:chars], add_special_tokens=False)
        if _first_unsafe_token(enc) > tokens:
            return text[:chars]
        head = enc.ids[:tokens + 1]
        if previous is not None and len(head) > tokens and head == previous:
            return text[:chars]
        previous = head
        chars *= 2
    return text


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # [num_tokens] int64: every text's ids, concatenated
    lengths: np.ndarray  # [num_texts] int32: tokens per text (its slice of input_ids)
    prompt_lengths: np.ndarray  # [num_texts] int32: leading tokens that pooling skips (0 = none)


class TextTokenizer:
    """Turns request texts into flat token ids for one model."""

    def __init__(self, spec: ModelSpec, limits: StringLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or EngineConfig(model_dir=str(spec.path)).text_limits()
        self._truncating = Tokenizer.from_file(str(spec.tokenizer_file))
        self._truncating.no_padding()
        self._truncating.enable_truncation(spec.max_seq_length)
        self._whole = Tokenizer.from_file(str(spec.tokenizer_file))
        self._whole.no_padding()
        self._whole.no_truncation()
        self._prompt_skip: dict[str, int] = {}

    def resolve_prompt(self, prompt_name: str | None) -> str:
        """The prefix for `prompt_name` (None: the folder's default prompt, if any)."""
        name = prompt_name if prompt_name is not None else self.spec.default_prompt_name
        if not name:
            return ""
        if name not in self.spec.prompts:
            known = ", ".join(sorted(self.spec.prompts)) or "none"
            raise RequestError(f"unknown prompt name {quote(name)}; this model's prompts: {known}")
        return self.spec.prompts[name]

    def _skip_for(self, prompt: str) -> int:
        """Prompt tokens that pooling leaves out, counted as sentence-transformers does."""
        if not prompt or self.spec.include_prompt:
            return 0
        if prompt not in self._prompt_skip:
            self._prompt_skip[prompt] = len(self._whole.encode(prompt).ids) - 1
        return self._prompt_skip[prompt]

    def encode(self, texts: list[str | bytes], prompt_name: str | None = None, truncate: bool = True) -> Encoded:
        """Texts (str, or UTF-8 bytes as Triton hands them) -> flat ids. The request's limits
        are checked before anything is tokenized."""
        texts = read_strings(texts, "TEXT", "text", self.limits)
        prompt = self.resolve_prompt(prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        if self.spec.do_lower_case:
            texts = [t.lower() for t in texts]
        # Over-long texts: tokenize a covering prefix; one more token than the limit tells
        # "too long" apart when truncation is off.
        keep = self.spec.max_seq_length + 1
        texts = [covering_prefix(self._whole, t, keep) if len(t) > keep * CHARS_PER_TOKEN else t for t in texts]
        tokenizer = self._truncating if truncate else self._whole
        encodings = tokenizer.encode_batch(texts, add_special_tokens=True)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings))
        if not truncate:
            too_long = np.flatnonzero(lengths > self.spec.max_seq_length)
            if too_long.size:
                i = int(too_long[0])
                raise RequestError(
                    f"TEXT[{i}] has more than {self.spec.max_seq_length} tokens, over this model's limit of "
                    f"{self.spec.max_seq_length}; shorten it or allow truncation (TRUNCATE=true)"
                )
        input_ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        skip = self._skip_for(prompt)
        prompt_lengths = np.full(len(texts), skip, dtype=np.int32)
        return Encoded(input_ids=input_ids, lengths=lengths, prompt_lengths=prompt_lengths)
