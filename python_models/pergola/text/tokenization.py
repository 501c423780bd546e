"""The gateway's CPU work: prompts, batch tokenization, truncation, token counts.

Tokenization is batched through HF `tokenizers` (Rust, parallel across texts); the only Python
loop gathers each encoding's ids into one flat array, which the encoder needs anyway. Texts are
tokenized without special tokens, cut in numpy, and wrapped in the special tokens the
tokenizer's post-processor adds (`Template`, probed once): one path for every truncation mode,
with the same ids as Hugging Face's truncation and a flag per text telling whether it was cut.

Truncation modes (`TRUNCATE_MODE`, as NIM's `truncate`): END keeps a text's start (Hugging
Face's default), START keeps its end, NONE refuses a text over the limit. A prompt is never cut:
START keeps the prompt's tokens and the end of the text.

Truncation-aware: a text far longer than the limit is not tokenized whole. Only a prefix (END,
NONE) or a suffix (START) that certainly yields the kept tokens is (`covering_prefix`,
`covering_suffix`), so a 5 MB text costs what a few kB do, with the same ids as tokenizing
everything and truncating.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding, Tokenizer

from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import ModelFolderError, ModelSpec
from pergola.text.chunking import ChunkLimits, late_ranges, text_spans, window_count, window_starts
from pergola.text.errors import RequestError, StringLimits, quote, read_strings

# A first prefix of CHARS_PER_TOKEN characters per kept token covers them in nearly every
# language (English ~4.5 characters a token, CJK ~1, code with long whitespace tokens more);
# when it does not, the prefix doubles.
CHARS_PER_TOKEN = 8

TRUNCATE_MODES: tuple[str, ...] = ("NONE", "START", "END")


def truncate_mode(value: str | bool | None, default: str | bool = "END", name: str = "TRUNCATE_MODE") -> str:
    """NONE | START | END from a mode name (any case) or the BOOL form (true = END, false = NONE)."""
    if value is None:
        value = default
    if isinstance(value, (bool, np.bool_)):
        return "END" if value else "NONE"
    mode = str(value).upper()
    if mode not in TRUNCATE_MODES:
        raise RequestError(f"{name}={quote(value)} is not a truncation mode; send NONE (refuse texts over the "
                           "limit), START (cut their start) or END (cut their end)")
    return mode


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


def _safe_tail(enc: Encoding) -> int:
    """How many of a suffix's last tokens are certainly the whole text's at the same place.

    The mirror of `_first_unsafe_token`: the suffix's first word may be cut, and a pre-tokenizer
    that starts matching at another character may split the next word differently (".,abc" is
    ".," "abc" whole but ",abc" from the comma); from the third word on the splits agree.
    """
    words = [w for w in enc.word_ids if w is not None]
    if not words:
        return 0
    safe_from = min(words) + 2
    first = next((i for i, w in enumerate(enc.word_ids) if w is not None and w >= safe_from), len(enc.ids))
    return len(enc.ids) - first


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


def covering_suffix(whole: Tokenizer, text: str, tokens: int) -> str:
    """The shortest tried suffix of `text` whose last `tokens` tokens are the whole text's (START
    truncation's `covering_prefix`; a giant word is settled the same way, by two suffixes agreeing)."""
    chars = max(512, tokens * CHARS_PER_TOKEN)
    previous: list[int] | None = None
    while chars < len(text):
        enc = whole.encode(text[-chars:], add_special_tokens=False)
        if _safe_tail(enc) > tokens:
            return text[-chars:]
        tail = enc.ids[-(tokens + 1):]
        if previous is not None and len(tail) > tokens and tail == previous:
            return text[-chars:]
        previous = tail
        chars *= 2
    return text


def window(whole: Tokenizer, text: str, mode: str, head: int, keep: int) -> str:
    """The part of `text` to tokenize: it holds every token `mode` keeps of the first `keep` (END,
    NONE) or of the first `head` and the last `keep - head` (START). Asked for one token more than
    the limit, the window tells a text over it apart. Short texts are their own window."""
    if len(text) <= keep * CHARS_PER_TOKEN:
        return text
    if mode != "START":
        return covering_prefix(whole, text, keep)
    tail = covering_suffix(whole, text, keep - head)
    front = covering_prefix(whole, text, head + 1) if head else ""
    return text if len(front) + len(tail) >= len(text) else front + tail


def cut(ids: np.ndarray, budget: int, mode: str, head: int = 0) -> np.ndarray:
    """`ids` [n] cut to `budget` tokens: END keeps the first, START the first `head` (a prompt, a
    reranker's instruction and query) and the last `budget - head`."""
    if len(ids) <= budget:
        return ids
    if mode == "END":
        return ids[:budget]
    return np.concatenate([ids[:head], ids[len(ids) - (budget - head):]])


@dataclass(frozen=True)
class Template:
    """The tokens a tokenizer's post-processor puts around one sequence, or a pair (BERT:
    [CLS] a [SEP] b [SEP]), with their token types: found by post-processing probes, so that
    sequences cut in numpy get exactly what Hugging Face would add after its truncation."""

    parts: tuple[np.ndarray, ...]  # ids before, (between,) after the sequences, int64
    part_types: tuple[np.ndarray, ...]  # their token types
    sequence_types: tuple[int, ...]  # the token type of each sequence's own tokens

    @property
    def added(self) -> int:
        return sum(len(p) for p in self.parts)

    @classmethod
    def probe(cls, tokenizer: Tokenizer, pair: bool = False) -> Template:
        probes = [tokenizer.encode(t, add_special_tokens=False) for t in ("hello", "world")[:1 + pair]]
        full = tokenizer.post_process(probes[0], probes[1] if pair else None, add_special_tokens=True)
        ids, types = np.asarray(full.ids, dtype=np.int64), np.asarray(full.type_ids, dtype=np.int64)
        bounds = [0]  # part k lies between sequence k-1 and sequence k
        for probe in probes:  # each sequence's ids, in order, after the previous one
            n = len(probe.ids)
            at = next((i for i in range(bounds[-1], len(ids) - n + 1) if full.ids[i:i + n] == probe.ids), None)
            if at is None:
                raise ModelFolderError("the tokenizer's post-processor does more than add special tokens "
                                       "around each sequence; pergola cannot truncate for it")
            bounds += [at, at + n]
        bounds.append(len(ids))
        template = cls(parts=tuple(ids[a:b] for a, b in zip(bounds[::2], bounds[1::2])),
                       part_types=tuple(types[a:b] for a, b in zip(bounds[::2], bounds[1::2])),
                       sequence_types=tuple(int(types[bounds[2 * k + 1]]) for k in range(len(probes))))
        if template.added != tokenizer.num_special_tokens_to_add(is_pair=pair):
            raise ModelFolderError("the tokenizer's post-processor adds tokens pergola cannot place")
        return template

    def ids(self, *sequences: np.ndarray) -> list[np.ndarray]:
        """The pieces of one post-processed sequence (or pair), in order, for np.concatenate."""
        out = [self.parts[0]]
        for k, s in enumerate(sequences):
            out += (s, self.parts[k + 1])
        return out

    def types(self, *lengths: int) -> list[np.ndarray]:
        out = [self.part_types[0]]
        for k, n in enumerate(lengths):
            out += (np.full(n, self.sequence_types[k], dtype=np.int64), self.part_types[k + 1])
        return out


@dataclass(frozen=True)
class Encoded:
    input_ids: np.ndarray  # [num_tokens] int64: every text's ids, concatenated
    lengths: np.ndarray  # [num_texts] int32: tokens per text (its slice of input_ids)
    prompt_lengths: np.ndarray  # [num_texts] int32: leading tokens that pooling skips (0 = none)
    truncated: np.ndarray  # [num_texts] bool: the text was cut to the limit


@dataclass(frozen=True)
class Chunks:
    """Texts cut into windows (pergola.text.chunking): what to encode, and which chunk is which."""

    encoded: Encoded  # the sequences: a window's text each (each, mean), or the encoding windows (late)
    sequences: np.ndarray  # [n] int32: sequences of each text, in order
    chunks: np.ndarray  # [n] int32: chunks of each text
    spans: np.ndarray  # [k, 2] int32: each chunk's characters [start, end) in its text
    tokens: np.ndarray  # [k] int32: each chunk's tokens of its text's tokenization
    ranges: np.ndarray  # [m, 3] int64, late: CHUNK_SPANS rows (chunk, start, end) over encoded.input_ids

    @classmethod
    def join(cls, parts: list[Chunks]) -> Chunks:
        """The chunks of consecutive groups of texts as those of all of them (ranges renumbered)."""
        if len(parts) == 1:
            return parts[0]
        chunks = np.cumsum([0] + [int(p.chunks.sum()) for p in parts[:-1]])
        tokens = np.cumsum([0] + [int(p.encoded.input_ids.size) for p in parts[:-1]])
        ranges = [p.ranges + np.array([k, t, t], dtype=np.int64) for p, k, t in zip(parts, chunks, tokens)]

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(p.encoded, name) for p in parts])

        encoded = Encoded(joined("input_ids"), joined("lengths"), joined("prompt_lengths"), joined("truncated"))
        return cls(encoded, *(np.concatenate([getattr(p, f) for p in parts])
                              for f in ("sequences", "chunks", "spans", "tokens")), np.concatenate(ranges))


@dataclass(frozen=True)
class Tokens:
    """What the tokenizer makes of texts, token by token (TEI's /tokenize), without truncation."""

    input_ids: np.ndarray  # [num_tokens] int64: every text's ids, concatenated
    lengths: np.ndarray  # [num_texts] int32
    offsets: np.ndarray  # [num_tokens, 2] int32: characters [start, stop) in the text as tokenized
    #                      (its prompt first); -1, -1 for a special token
    pieces: list[str]  # [num_tokens]: each token's characters, or a special token's own text


def _text_tokens(enc: Encoding, prompt_chars: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prompt + text tokenization -> (the prompt's ids, the text's ids, the text's token offsets
    [n, 2] in the text): the prompt's tokens are those that begin in its characters."""
    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    ids = np.asarray(enc.ids, dtype=np.int64)
    head = int(np.searchsorted(offsets[:, 0], prompt_chars)) if prompt_chars else 0
    return ids[:head], ids[head:], offsets[head:] - prompt_chars


def check_windows(counts: list[int], limits: ChunkLimits | None) -> None:
    """RequestError (a limit: 413) for a text, or texts, cut into more windows than `limits` allow."""
    if limits is None:
        return
    most = max(counts)
    if most > limits.per_text:
        i = counts.index(most)
        raise RequestError(f"TEXT[{i}] makes {most:,} windows; the limit is {limits.per_text:,} windows a text "
                           "(max_text_chunks): send larger windows, or the text in parts")
    if sum(counts) > limits.per_request:
        raise RequestError(f"the texts make {sum(counts):,} windows; the limit is {limits.per_request:,} windows a "
                           "request (max_request_chunks): send fewer texts, or larger windows")


def token_limit(model_max: int, max_tokens: int | None, name: str = "MAX_TOKENS") -> int:
    """The request's limit: the model's, or `max_tokens` when that is lower (0 or None: the model's)."""
    if max_tokens is None or max_tokens == 0:
        return model_max
    if max_tokens < 0:
        raise RequestError(f"{name}={max_tokens} must be positive (0 or omitted = this model's limit)")
    return min(model_max, int(max_tokens))


class TextTokenizer:
    """Turns request texts into flat token ids for one model."""

    def __init__(self, spec: ModelSpec, limits: StringLimits | None = None) -> None:
        self.spec = spec
        self.limits = limits or EngineConfig(model_dir=str(spec.path)).text_limits()
        self._whole = Tokenizer.from_file(str(spec.tokenizer_file))
        self._whole.no_padding()
        self._whole.no_truncation()
        self.template = Template.probe(self._whole)
        self._prompt_skip: dict[str, int] = {}
        self._prompt_tokens: dict[str, int] = {}

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

    def _head_for(self, prompt: str) -> int:
        """The prompt's own tokens: what START truncation keeps at the front."""
        if prompt not in self._prompt_tokens:
            self._prompt_tokens[prompt] = len(self._whole.encode(prompt, add_special_tokens=False).ids)
        return self._prompt_tokens[prompt]

    def _budget(self, limit: int, head: int, max_tokens: int | None) -> int:
        """Text tokens a sequence may hold within `limit`, refused when nothing of a text would fit."""
        budget = limit - self.template.added
        if budget <= head:
            what = f"MAX_TOKENS={max_tokens}" if limit < self.spec.max_seq_length else f"this model's limit of {limit}"
            need = self.template.added + head + 1
            raise RequestError(f"{what} leaves no room for text: the special tokens and the prompt take "
                               f"{need - 1}; allow at least {need} tokens")
        return budget

    def _too_long(self, i: int, limit: int, max_tokens: int | None) -> RequestError:
        whose = "this request's limit" if limit < self.spec.max_seq_length else "this model's limit"
        hint = " (MAX_TOKENS)" if limit < self.spec.max_seq_length else ""
        return RequestError(f"TEXT[{i}] has more than {limit} tokens, over {whose} of {limit}{hint}; "
                            "shorten it or allow truncation (TRUNCATE_MODE=END or START, or TRUNCATE=true)")

    def tokenize(self, texts: list[str | bytes], prompt_name: str | None = None,
                 add_special_tokens: bool = True) -> Tokens:
        """Every token of each text (its prompt first) with its characters and offsets: what
        TEI's /tokenize shows. Nothing is cut: it says how long a text is for this model."""
        texts = read_strings(texts, "TEXT", "text", self.limits)
        prompt = self.resolve_prompt(prompt_name)
        texts = [prompt + t for t in texts]
        if self.spec.do_lower_case:
            texts = [t.lower() for t in texts]
        encodings = self._whole.encode_batch(texts, add_special_tokens=add_special_tokens)
        pieces: list[str] = []
        offsets: list[tuple[int, int]] = []
        for text, e in zip(texts, encodings):
            for token, (start, stop), special in zip(e.tokens, e.offsets, e.special_tokens_mask):
                pieces.append(token if special else text[start:stop])
                offsets.append((-1, -1) if special else (start, stop))
        return Tokens(input_ids=np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=len(pieces)),
                      lengths=np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings)),
                      offsets=np.asarray(offsets, dtype=np.int32).reshape(-1, 2), pieces=pieces)

    def encode(self, texts: list[str | bytes], prompt_name: str | None = None, truncate: bool | str = True,
               max_tokens: int | None = None) -> Encoded:
        """Texts (str, or UTF-8 bytes as Triton hands them) -> flat ids. `truncate`: a mode or
        its BOOL form; `max_tokens`: a limit below the model's (0 or None: the model's). The
        request's limits are checked before anything is tokenized."""
        texts = read_strings(texts, "TEXT", "text", self.limits)
        return self._encode(texts, self.resolve_prompt(prompt_name), truncate_mode(truncate), max_tokens)

    def _encode(self, texts: list[str], prompt: str, mode: str, max_tokens: int | None) -> Encoded:
        limit = token_limit(self.spec.max_seq_length, max_tokens)
        head = self._head_for(prompt) if prompt and mode == "START" else 0
        budget = self._budget(limit, self._head_for(prompt) if prompt else 0, max_tokens)
        if prompt:
            texts = [prompt + t for t in texts]
        if self.spec.do_lower_case:
            texts = [t.lower() for t in texts]
        # Over-long texts: tokenize a covering window; one more token than the budget tells
        # "too long" apart.
        texts = [window(self._whole, t, mode, head, budget + 1) for t in texts]
        encodings = self._whole.encode_batch(texts, add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=np.int64) for e in encodings]
        truncated = np.fromiter((len(x) > budget for x in ids), dtype=bool, count=len(ids))
        if truncated.any():
            if mode == "NONE":
                raise self._too_long(int(np.flatnonzero(truncated)[0]), limit, max_tokens)
            ids = [cut(x, budget, mode, head) if t else x for x, t in zip(ids, truncated)]
        parts: list[np.ndarray] = []
        for x in ids:
            parts += self.template.ids(x)
        lengths = np.fromiter((len(x) + self.template.added for x in ids), dtype=np.int32, count=len(ids))
        prompt_lengths = np.full(len(texts), self._skip_for(prompt), dtype=np.int32)
        return Encoded(input_ids=np.concatenate(parts), lengths=lengths, prompt_lengths=prompt_lengths,
                       truncated=truncated)

    def chunk(self, texts: list[str | bytes], size: int | None = None, overlap: int = 0, late: bool = False,
              prompt_name: str | None = None, limits: ChunkLimits | None = None) -> Chunks:
        """Texts cut into windows of `size` text tokens (0 or None: the most a sequence holds beside
        the special tokens and the prompt), neighbours sharing `overlap` (pergola.text.chunking). `late`:
        each text is encoded whole, in windows of the model's length, and its chunks are CHUNK_SPANS
        over them. `size` and `overlap` are checked before anything is tokenized, the windows
        against `limits` before anything is encoded."""
        texts = read_strings(texts, "TEXT", "text", self.limits)
        prompt = self.resolve_prompt(prompt_name)
        head = self._head_for(prompt) if prompt else 0
        budget = self._budget(self.spec.max_seq_length, head, None) - head  # text tokens a sequence holds
        size = size or budget
        if not 1 <= size <= budget:
            raise RequestError(f"chunking.tokens (CHUNK_SIZE) = {size}: a window holds 1 to {budget} tokens of text "
                               "with this model "
                               f"(its limit of {self.spec.max_seq_length} less {self.spec.max_seq_length - budget} "
                               "special and prompt tokens; 0 or omitted = all of them)")
        if not 0 <= overlap < size:
            raise RequestError(f"chunking.overlap (CHUNK_OVERLAP) = {overlap} must be at least 0 and below the "
                               f"window's {size} tokens")
        lowered = [t.lower() for t in texts] if self.spec.do_lower_case else texts
        encodings = self._whole.encode_batch([prompt + t for t in lowered], add_special_tokens=False)
        cut = [_text_tokens(e, len(prompt)) for e in encodings]  # (prompt ids, text ids, text offsets) per text
        counts = [window_count(len(ids), size, overlap) for _, ids, _ in cut]
        check_windows(counts, limits)
        starts = [window_starts(len(ids), size, overlap) for _, ids, _ in cut]
        ends = [np.minimum(a + size, len(ids)) for a, (_, ids, _) in zip(starts, cut)]
        spans = [text_spans(offsets, a, b, len(t)) for (_, _, offsets), a, b, t in zip(cut, starts, ends, texts)]
        if late:
            encoded, sequences, ranges = self._late(cut, starts, ends, prompt, budget, overlap)
        else:
            windows = [t[a:b] for t, span in zip(texts, spans) for a, b in span.tolist()]
            encoded = self._encode(windows, prompt, "END", None)  # (a window re-tokenized may pass the budget)
            sequences, ranges = np.array(counts, dtype=np.int32), np.empty((0, 3), np.int64)
        return Chunks(encoded, sequences, np.array(counts, dtype=np.int32), np.concatenate(spans),
                      np.concatenate([b - a for a, b in zip(starts, ends)]).astype(np.int32), ranges)

    def _late(self, cut: list[tuple[np.ndarray, np.ndarray, np.ndarray]], starts: list[np.ndarray],
              ends: list[np.ndarray], prompt: str, budget: int, overlap: int) -> tuple[Encoded, np.ndarray, np.ndarray]:
        """Late chunking's encoding: each text in windows of `budget` tokens sharing `overlap`, with
        the special tokens and the prompt's tokens, and its chunks' CHUNK_SPANS over them."""
        macro = [window_starts(len(ids), budget, overlap) for _, ids, _ in cut]
        if max(map(len, macro)) > self.limits.max_count:
            i = max(range(len(macro)), key=lambda j: len(macro[j]))
            raise RequestError(f"TEXT[{i}] takes {len(macro[i]):,} sequences of this model's length to encode whole; "
                               f"the limit is {self.limits.max_count:,} sequences in a request (max_texts): "
                               "send it in parts")
        parts, lengths, ranges, flat, first_chunk = [], [], [], 0, 0
        lead = len(self.template.parts[0])
        for (head, ids, _), m, a, b in zip(cut, macro, starts, ends):
            seq_starts = []
            for start in m.tolist():
                window = np.concatenate([head, ids[start:start + budget]])
                parts += self.template.ids(window)
                seq_starts.append(flat)
                lengths.append(len(window) + self.template.added)
                flat += lengths[-1]
            rows = late_ranges(len(ids), a, b, m, overlap, np.array(seq_starts), lead + len(head),
                               np.array(lengths[-len(m):]))
            rows[:, 0] += first_chunk
            ranges.append(rows)
            first_chunk += len(a)
        lengths_array = np.array(lengths, dtype=np.int32)
        encoded = Encoded(input_ids=np.concatenate(parts), lengths=lengths_array,
                          prompt_lengths=np.full(len(lengths), self._skip_for(prompt), dtype=np.int32),
                          truncated=np.zeros(len(lengths), dtype=bool))
        return encoded, np.array([len(m) for m in macro], dtype=np.int32), np.concatenate(ranges)
