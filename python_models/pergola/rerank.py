"""Reranking: which kind of reranker a folder holds, (query, document) pairs to flat token ids
(one sequence per document), the answer tokens a Qwen3-Reranker is scored on, and the ranking of
a request's scores (TOP_N).

Two model kinds (`reranker_kind`):

* "cross-encoder" (BERT-style sequence classification, e.g. cross-encoder/ms-marco-MiniLM-L6-v2):
  each pair is tokenized exactly as the tokenizer's pair template does it ([CLS] query [SEP]
  document [SEP], token types 0 then 1), as sentence-transformers' CrossEncoder and
  `tokenizer(query, document)` do. Truncation cuts the document only ("only_second"), so the
  query always survives whole; sentence-transformers' default ("longest_first") would cut the
  query too once the document is shorter than it.
* "qwen3-reranker" (Qwen/Qwen3-Reranker-*): the published prompt, laid out as the official
  reference builds it: prefix ids + body ids + suffix ids, where the body
  "<Instruct>: ...\\n<Query>: ...\\n<Document>: ..." is tokenized on its own and cut from the right
  to max_length - len(prefix) - len(suffix). The document is the body's tail, so that cut removes
  document tokens only; a query whose instruction + query part leaves no room for the document is
  refused. No EOS is appended (the reranker's tokenizer has no post-processor); the score is read
  from the "no"/"yes" logits (`answer_ids`) at the last position.

Tokenization is batched through HF `tokenizers`; the only Python loop gathers ids into flat arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from pergola.config import EngineConfig
from pergola.errors import RequestError, read_strings
from pergola.hf_folder import ModelFolderError, ModelSpec
from pergola.tokenization import CHARS_PER_TOKEN, covering_prefix

RerankKind = Literal["cross-encoder", "qwen3-reranker"]
RERANK_KINDS: tuple[str, ...] = ("cross-encoder", "qwen3-reranker")

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANKER_MAX_LENGTH = 8192  # the official reference's max_length


def qwen3_reranker_body(instruction: str, query: str, document: str) -> str:
    """The official `format_instruction(instruction, query, doc)`."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def reranker_kind(spec: ModelSpec) -> RerankKind:
    """"cross-encoder" (BERT + classifier head) or "qwen3-reranker" (yes/no logits of a causal LM)."""
    if spec.task != "rerank":
        raise ValueError(f"{spec.path} is served as {spec.task!r}, not as a reranker")
    return "cross-encoder" if spec.architecture == "bert" else "qwen3-reranker"


class AnswerIds(NamedTuple):
    """Token ids of the Qwen3-Reranker's answer words: its score is softmax([no, yes] logits)[yes]."""

    no: int
    yes: int


def answer_ids(spec: ModelSpec, tokenizer: Tokenizer | None = None) -> AnswerIds:
    """The ids of "no" and "yes" in the folder's tokenizer (`tokenizer`: that file, already loaded)."""
    tokenizer = tokenizer or Tokenizer.from_file(str(spec.tokenizer_file))
    no, yes = tokenizer.token_to_id("no"), tokenizer.token_to_id("yes")
    if no is None or yes is None:
        raise ModelFolderError(f"{spec.path}: the tokenizer has no 'yes'/'no' tokens; is this a Qwen3 reranker?")
    return AnswerIds(int(no), int(yes))


@dataclass(frozen=True)
class RerankEncoded:
    input_ids: np.ndarray  # [num_tokens] int64: every pair's ids, concatenated
    lengths: np.ndarray  # [num_documents] int32: tokens per pair (its slice of input_ids)
    token_type_ids: np.ndarray  # [num_tokens] int64: segment ids (cross-encoder: 0 query, 1 document)


class RerankTokenizer:
    """Turns one rerank request (a query and its documents) into flat token ids."""

    def __init__(
        self,
        spec: ModelSpec,
        kind: RerankKind | None = None,
        config: EngineConfig | None = None,
        instruction: str | None = None,
        max_length: int | None = None,
    ) -> None:
        """config: the request limits (max_documents, max_text_chars, max_query_chars,
        max_request_chars; default EngineConfig's). max_length: tokens per pair (prompt included).
        Default: the folder's max_seq_length, and for qwen3-reranker at most 8192, as in the
        official reference. kind: the folder's (`reranker_kind`) unless given."""
        kind = kind or reranker_kind(spec)
        if kind not in RERANK_KINDS:
            raise ValueError(f"kind must be one of {RERANK_KINDS}, got {kind!r}")
        if kind == "cross-encoder" and instruction is not None:
            raise ValueError("an instruction only applies to kind 'qwen3-reranker'")
        self.spec = spec
        self.kind = kind
        config = config or EngineConfig(model_dir=str(spec.path))
        self.limits, self.query_limits = config.document_limits(), config.query_limits()
        if max_length is None:
            max_length = spec.max_seq_length
            if kind == "qwen3-reranker":
                max_length = min(max_length, QWEN3_RERANKER_MAX_LENGTH)
        self.max_length = int(max_length)
        self.instruction = QWEN3_RERANKER_INSTRUCTION if instruction is None else instruction
        self.answer_ids: AnswerIds | None = None  # qwen3-reranker: the tokens its score is read from

        self._whole = Tokenizer.from_file(str(spec.tokenizer_file))
        self._whole.no_padding()
        self._whole.no_truncation()
        self._truncating = Tokenizer.from_file(str(spec.tokenizer_file))
        self._truncating.no_padding()

        if kind == "cross-encoder":
            self._pair_specials = self._whole.num_special_tokens_to_add(is_pair=True)
            if self._pair_specials + 1 >= self.max_length:
                raise ValueError(f"max_length {self.max_length} leaves no room for a query and a document")
            self._truncating.enable_truncation(self.max_length, strategy="only_second", direction="right")
        else:
            self.prefix_ids = np.asarray(
                self._whole.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False).ids, dtype=np.int64)
            self.suffix_ids = np.asarray(
                self._whole.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False).ids, dtype=np.int64)
            self.body_budget = self.max_length - len(self.prefix_ids) - len(self.suffix_ids)
            if self.body_budget < 2:
                raise ValueError(f"max_length {self.max_length} leaves no room for the reranker prompt")
            self._truncating.enable_truncation(self.body_budget, strategy="longest_first", direction="right")
            self.answer_ids = answer_ids(spec, self._whole)

    def read_request(self, query: str | bytes, documents: list[str | bytes]) -> tuple[str, list[str]]:
        """The query and documents decoded and checked against the limits, before any tokenization."""
        [query] = read_strings([query], "QUERY", "query", self.query_limits)
        return query, read_strings(documents, "DOCUMENTS", "document", self.limits, used_chars=len(query))

    def _query_too_long(self, used: int, room: int) -> RequestError:
        what = "the instruction and query take" if self.kind == "qwen3-reranker" else "the query takes"
        return RequestError(
            f"QUERY is too long: {what} {used} of this model's {room} tokens per pair, leaving no room "
            "for the document; shorten the query"
        )

    def _over_limit(self, i: int, n: int) -> RequestError:
        return RequestError(
            f"DOCUMENTS[{i}] with the query is {n} tokens, over this model's limit of {self.max_length}; "
            "shorten the document or allow truncation (TRUNCATE=true)"
        )

    def encode(self, query: str | bytes, documents: list[str | bytes], truncate: bool = True) -> RerankEncoded:
        query, documents = self.read_request(query, documents)
        if self.kind == "cross-encoder":
            return self._encode_cross_encoder(query, documents, truncate)
        return self._encode_qwen3(query, documents, truncate)

    def _encode_cross_encoder(self, query: str, documents: list[str], truncate: bool) -> RerankEncoded:
        query_len = len(self._whole.encode(query, add_special_tokens=False).ids)
        if query_len + self._pair_specials + 1 > self.max_length:  # not even one document token fits
            raise self._query_too_long(query_len + self._pair_specials, self.max_length)
        tokenizer = self._truncating if truncate else self._whole
        # A document far over the limit: only a prefix covering its kept tokens (+1 to tell "too
        # long" apart) is tokenized; the pair template tokenizes query and document separately.
        keep = self.max_length + 1
        documents = [covering_prefix(self._whole, d, keep) if len(d) > keep * CHARS_PER_TOKEN else d
                     for d in documents]
        encodings = tokenizer.encode_batch([(query, doc) for doc in documents], add_special_tokens=True)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int32, count=len(encodings))
        if not truncate:
            too_long = np.flatnonzero(lengths > self.max_length)
            if too_long.size:
                i = int(too_long[0])
                raise self._over_limit(i, int(lengths[i]))
        input_ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        token_type_ids = np.concatenate([np.asarray(e.type_ids, dtype=np.int64) for e in encodings])
        return RerankEncoded(input_ids=input_ids, lengths=lengths, token_type_ids=token_type_ids)

    def _encode_qwen3(self, query: str, documents: list[str], truncate: bool) -> RerankEncoded:
        # Everything before the document; the body's tokens start with exactly these (the
        # pre-tokenizer always splits after "<Document>:", whose next character is a space).
        head = qwen3_reranker_body(self.instruction, query, "").rstrip(" ")
        head_len = len(self._whole.encode(head, add_special_tokens=False).ids)
        if head_len + 1 > self.body_budget:
            raise self._query_too_long(head_len + len(self.prefix_ids) + len(self.suffix_ids), self.max_length)
        keep = self.body_budget + 1  # the body is cut from the right: its head, then the document
        bodies = [qwen3_reranker_body(self.instruction, query, doc) for doc in documents]
        bodies = [covering_prefix(self._whole, b, keep) if len(b) > keep * CHARS_PER_TOKEN else b for b in bodies]
        tokenizer = self._truncating if truncate else self._whole
        encodings = tokenizer.encode_batch(bodies, add_special_tokens=True)
        extra = len(self.prefix_ids) + len(self.suffix_ids)
        lengths = np.fromiter((len(e.ids) + extra for e in encodings), dtype=np.int32, count=len(encodings))
        if not truncate:
            too_long = np.flatnonzero(lengths > self.max_length)
            if too_long.size:
                i = int(too_long[0])
                raise self._over_limit(i, int(lengths[i]))
        parts: list[np.ndarray] = []
        for e in encodings:
            parts += (self.prefix_ids, np.asarray(e.ids, dtype=np.int64), self.suffix_ids)
        input_ids = np.concatenate(parts)
        token_type_ids = np.zeros(len(input_ids), dtype=np.int64)
        return RerankEncoded(input_ids=input_ids, lengths=lengths, token_type_ids=token_type_ids)


@dataclass(frozen=True)
class RerankOptions:
    """What a rerank request asks of its answer: TOP_N, how many indices to list (0: all documents)."""

    top_n: int = 0

    def __post_init__(self) -> None:
        if self.top_n < 0:
            raise RequestError(f"TOP_N={self.top_n} must be positive (0 or omitted = all documents)")


def rank(scores: np.ndarray, top_n: int = 0) -> np.ndarray:
    """Indices of scores [n], best first (equal scores in input order): [min(top_n, n)] int32, 0 = all."""
    order = np.argsort(-scores, kind="stable").astype(np.int32)
    return order[:top_n] if top_n else order
