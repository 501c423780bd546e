"""Reranking: which kind of reranker a folder holds, (query, document) pairs to flat token ids
(one sequence per document), the answer tokens a Qwen3-Reranker is scored on, and the ranking of
a request's scores (TOP_N).

Two model kinds (`reranker_kind`):

* "cross-encoder" (BERT-style sequence classification, e.g. cross-encoder/ms-marco-MiniLM-L6-v2):
  each pair is tokenized exactly as the tokenizer's pair template does it ([CLS] query [SEP]
  document [SEP], token types 0 then 1), as sentence-transformers' CrossEncoder and
  `tokenizer(query, document)` do. Truncation cuts the document only ("only_second"), so the
  query always survives whole; sentence-transformers' default ("longest_first") would cut the
  query too once the document is shorter than it. TRUNCATE_MODE END cuts the document's end,
  START its start (transformers' truncation_side="left"); MAX_DOCUMENT_TOKENS caps a document.
* "qwen3-reranker" (Qwen/Qwen3-Reranker-*): the published prompt, laid out as the official
  reference builds it: prefix ids + body ids + suffix ids, where the body
  "<Instruct>: ...\\n<Query>: ...\\n<Document>: ..." is tokenized on its own and cut from the right
  to max_length - len(prefix) - len(suffix). The document is the body's tail, so that cut removes
  document tokens only (START keeps the instruction and query and cuts the document's start); a
  query whose instruction + query part leaves no room for the document is refused. A request may
  send its own INSTRUCTION (the task, e.g. "Given a legal question, find the clause that answers it"). No EOS is appended (the reranker's tokenizer has no post-processor); the score is read
  from the "no"/"yes" logits (`answer_ids`) at the last position.

Tokenization is batched through HF `tokenizers`; the only Python loop gathers ids into flat arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from pergola.config import EngineConfig
from pergola.errors import RequestError, StringLimits, read_strings
from pergola.hf_folder import ModelFolderError, ModelSpec
from pergola.tokenization import Template, cut, truncate_mode, window

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
    """"qwen3-reranker" (yes/no logits of a causal LM) or "cross-encoder" (an encoder with a
    sequence-classification head: BERT, XLM-RoBERTa, ModernBERT)."""
    if spec.task != "rerank":
        raise ValueError(f"{spec.path} is served as {spec.task!r}, not as a reranker")
    return "qwen3-reranker" if spec.architecture == "qwen3" else "cross-encoder"


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
    truncated: np.ndarray  # [num_documents] bool: the document was cut


class RerankTokenizer:
    """Turns one rerank request (a query and its documents) into flat token ids.

    Documents are tokenized without special tokens, cut in numpy (`pergola.tokenization.cut`:
    END keeps a document's start, START its end; the query and a Qwen3 instruction are never
    cut) and wrapped as the tokenizer's post-processor does (`Template`), so the ids equal
    Hugging Face's truncation "only_second" (cross-encoder) or the official reference's.
    """

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
        official reference. kind: the folder's (`reranker_kind`) unless given. instruction: the
        default of requests that send none (qwen3-reranker only)."""
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

        if kind == "cross-encoder":
            self.template = Template.probe(self._whole, pair=True)
            if self.template.added + 1 >= self.max_length:
                raise ValueError(f"max_length {self.max_length} leaves no room for a query and a document")
        else:
            self.template = Template.probe(self._whole)
            self.prefix_ids = np.asarray(
                self._whole.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False).ids, dtype=np.int64)
            self.suffix_ids = np.asarray(
                self._whole.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False).ids, dtype=np.int64)
            # the body's own tokens (its post-processor's, if any, come out of it as with HF's truncation)
            self.body_budget = self.max_length - len(self.prefix_ids) - len(self.suffix_ids) - self.template.added
            if self.body_budget < 2:
                raise ValueError(f"max_length {self.max_length} leaves no room for the reranker prompt")
            self.answer_ids = answer_ids(spec, self._whole)

    def read_request(self, query: str | bytes, documents: list[str | bytes]) -> tuple[str, list[str]]:
        """The query and documents decoded and checked against the limits, before any tokenization."""
        [query] = read_strings([query], "QUERY", "query", self.query_limits)
        return query, read_strings(documents, "DOCUMENTS", "document", self.limits, used_chars=len(query))

    def _read_instruction(self, instruction: str | bytes | None, query: str) -> str:
        """The request's INSTRUCTION (counted with the query against max_query_chars), or the default."""
        if instruction is None:
            return self.instruction
        if self.kind != "qwen3-reranker":
            raise RequestError("INSTRUCTION applies to Qwen3-Reranker models; this cross-encoder takes none: "
                               "leave it out")
        limits = StringLimits(1, self.query_limits.max_chars, self.query_limits.max_chars, "max_query_chars")
        [text] = read_strings([instruction], "INSTRUCTION", "instruction", limits, used_chars=len(query))
        return text

    def _query_too_long(self, used: int, room: int) -> RequestError:
        what = "the instruction and query take" if self.kind == "qwen3-reranker" else "the query takes"
        return RequestError(
            f"QUERY is too long: {what} {used} of this model's {room} tokens per pair, leaving no room "
            "for the document; shorten the query"
        )

    def _over_limit(self, i: int, n: int, max_document_tokens: int | None) -> RequestError:
        if max_document_tokens:
            return RequestError(f"DOCUMENTS[{i}] has more than {max_document_tokens} tokens, over this request's "
                                f"limit of {max_document_tokens} (MAX_DOCUMENT_TOKENS); shorten the document or "
                                "allow truncation (TRUNCATE_MODE=END or START, or TRUNCATE=true)")
        return RequestError(
            f"DOCUMENTS[{i}] with the query is {n} tokens, over this model's limit of {self.max_length}; "
            "shorten the document or allow truncation (TRUNCATE_MODE=END or START, or TRUNCATE=true)"
        )

    def encode(self, query: str | bytes, documents: list[str | bytes], truncate: bool | str = True,
               max_document_tokens: int | None = None, instruction: str | bytes | None = None) -> RerankEncoded:
        """truncate: a mode (NONE | START | END) or its BOOL form; max_document_tokens: a
        document's most tokens (0 or None: what the model's limit leaves); instruction: this
        request's Qwen3-Reranker instruction (None: the default)."""
        query, documents = self.read_request(query, documents)
        instruction = self._read_instruction(instruction, query)
        mode = truncate_mode(truncate)
        if max_document_tokens is not None and max_document_tokens < 0:
            raise RequestError(f"MAX_DOCUMENT_TOKENS={max_document_tokens} must be positive (0 or omitted = "
                               "what the model's limit leaves)")
        if self.kind == "cross-encoder":
            return self._encode_cross_encoder(query, documents, mode, max_document_tokens)
        return self._encode_qwen3(query, documents, mode, max_document_tokens, instruction)

    def _cut(self, texts: list[str], mode: str, head: int, budget: int, extra: int,
             max_document_tokens: int | None) -> tuple[list[np.ndarray], np.ndarray]:
        """Each text's ids cut to `budget` (`head` leading ids kept whole); a document far over it is
        tokenized only as far as a covering window. `extra`: the pair's tokens besides these."""
        texts = [window(self._whole, t, mode, head, budget + 1) for t in texts]
        ids = [np.asarray(e.ids, dtype=np.int64) for e in self._whole.encode_batch(texts, add_special_tokens=False)]
        truncated = np.fromiter((len(x) > budget for x in ids), dtype=bool, count=len(ids))
        if truncated.any():
            if mode == "NONE":
                i = int(np.flatnonzero(truncated)[0])
                raise self._over_limit(i, len(ids[i]) + extra, max_document_tokens)
            ids = [cut(x, budget, mode, head) if t else x for x, t in zip(ids, truncated)]
        return ids, truncated

    def _encode_cross_encoder(self, query: str, documents: list[str], mode: str,
                              max_document_tokens: int | None) -> RerankEncoded:
        # The pair template tokenizes query and document separately: the query once, then the
        # documents, cut to what the query leaves ("only_second").
        q = np.asarray(self._whole.encode(query, add_special_tokens=False).ids, dtype=np.int64)
        room = self.max_length - self.template.added - len(q)
        if room < 1:  # not even one document token fits
            raise self._query_too_long(len(q) + self.template.added, self.max_length)
        budget = min(room, max_document_tokens) if max_document_tokens else room
        ids, truncated = self._cut(documents, mode, 0, budget, len(q) + self.template.added, max_document_tokens)
        parts: list[np.ndarray] = []
        types: list[np.ndarray] = []
        for x in ids:
            parts += self.template.ids(q, x)
            types += self.template.types(len(q), len(x))
        lengths = np.fromiter((len(q) + len(x) + self.template.added for x in ids), dtype=np.int32, count=len(ids))
        # A model without segment embeddings (XLM-R, ModernBERT) reads none: its HF tokenizer does not
        # return them, whatever the pair template marks the document with.
        type_ids = np.concatenate(types) if self.spec.type_vocab_size > 1 else np.zeros(lengths.sum(), np.int64)
        return RerankEncoded(input_ids=np.concatenate(parts), lengths=lengths, token_type_ids=type_ids,
                             truncated=truncated)

    def _encode_qwen3(self, query: str, documents: list[str], mode: str, max_document_tokens: int | None,
                      instruction: str) -> RerankEncoded:
        # Everything before the document; the body's tokens start with exactly these (the
        # pre-tokenizer always splits after "<Document>:", whose next character is a space).
        # Truncation cuts the body after them (END) or keeps them and the body's end (START).
        head = qwen3_reranker_body(instruction, query, "").rstrip(" ")
        head_len = len(self._whole.encode(head, add_special_tokens=False).ids)
        extra = len(self.prefix_ids) + len(self.suffix_ids) + self.template.added
        if head_len + 1 > self.body_budget:
            raise self._query_too_long(head_len + extra, self.max_length)
        budget = min(self.body_budget, head_len + max_document_tokens) if max_document_tokens else self.body_budget
        bodies = [qwen3_reranker_body(instruction, query, doc) for doc in documents]
        ids, truncated = self._cut(bodies, mode, head_len, budget, extra, max_document_tokens)
        parts: list[np.ndarray] = []
        for x in ids:
            parts += (self.prefix_ids, *self.template.ids(x), self.suffix_ids)
        input_ids = np.concatenate(parts)
        lengths = np.fromiter((len(x) + extra for x in ids), dtype=np.int32, count=len(ids))
        return RerankEncoded(input_ids=input_ids, lengths=lengths,
                             token_type_ids=np.zeros(len(input_ids), dtype=np.int64), truncated=truncated)


@dataclass(frozen=True)
class RerankOptions:
    """What a rerank request asks of its answer: TOP_N, how many indices to list (0: all documents);
    RAW_SCORES, the logits (cross-encoder: the classifier's; Qwen3-Reranker: logit(yes) - logit(no))
    instead of their sigmoid."""

    top_n: int = 0
    raw_scores: bool = False

    def __post_init__(self) -> None:
        if self.top_n < 0:
            raise RequestError(f"TOP_N={self.top_n} must be positive (0 or omitted = all documents)")


def rank(scores: np.ndarray, top_n: int = 0) -> np.ndarray:
    """Indices of scores [n], best first (equal scores in input order): [min(top_n, n)] int32, 0 = all."""
    order = np.argsort(-scores, kind="stable").astype(np.int32)
    return order[:top_n] if top_n else order
