"""The gateway's CPU work: prompts, batch tokenization, truncation, token counts.

Tokenization is batched through HF `tokenizers` (Rust, parallel across texts); the only Python
loop is the gather of each encoding's ids into one flat array, which the encoder needs anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from pergola.errors import RequestError, check_strings
from pergola.hf_folder import ModelSpec


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # [num_tokens] int64: every text's ids, concatenated
    lengths: np.ndarray  # [num_texts] int32: tokens per text (its slice of input_ids)
    prompt_lengths: np.ndarray  # [num_texts] int32: leading tokens that pooling skips (0 = none)


class TextTokenizer:
    """Turns request texts into flat token ids for one model."""

    def __init__(self, spec: ModelSpec, max_texts: int = 1024) -> None:
        self.spec = spec
        self.max_texts = max_texts
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
            raise RequestError(f"unknown prompt name {name!r}; this model's prompts: {known}")
        return self.spec.prompts[name]

    def _skip_for(self, prompt: str) -> int:
        """Prompt tokens that pooling leaves out, counted as sentence-transformers does."""
        if not prompt or self.spec.include_prompt:
            return 0
        if prompt not in self._prompt_skip:
            self._prompt_skip[prompt] = len(self._whole.encode(prompt).ids) - 1
        return self._prompt_skip[prompt]

    def encode(self, texts: list[str], prompt_name: str | None = None, truncate: bool = True) -> Encoded:
        check_strings(texts, "TEXT", "text", self.max_texts)
        prompt = self.resolve_prompt(prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        if self.spec.do_lower_case:
            texts = [t.lower() for t in texts]
        tokenizer = self._truncating if truncate else self._whole
        encodings = tokenizer.encode_batch(texts, add_special_tokens=True)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings))
        if not truncate:
            too_long = np.flatnonzero(lengths > self.spec.max_seq_length)
            if too_long.size:
                i = int(too_long[0])
                raise RequestError(
                    f"TEXT[{i}] has {int(lengths[i])} tokens, over this model's limit of "
                    f"{self.spec.max_seq_length}; shorten it or allow truncation (TRUNCATE=true)"
                )
        input_ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        skip = self._skip_for(prompt)
        prompt_lengths = np.full(len(texts), skip, dtype=np.int32)
        return Encoded(input_ids=input_ids, lengths=lengths, prompt_lengths=prompt_lengths)
