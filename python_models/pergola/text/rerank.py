"""Reranking: which kind of reranker a folder holds, (query, document) pairs to flat token ids
(one sequence per document), the answer tokens a Qwen3-Reranker is scored on, and the ranking of
a request's scores (TOP_N).

Three layouts of a pair (`reranker_kind`):

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
* "mxbai-rerank-v2" (mixedbread-ai/mxbai-rerank-base-v2, -large-v2: Qwen2 causal LMs): the
  prompt of the official `mxbai_rerank` package, each part tokenized on its own as it does:
  chat prefix, "[instruction: ...\\n]query: ...", "\\n", "document: ...", "\\n", the relevance
  task prompt, chat suffix; the score is read from the "0"/"1" logits. The official package also
  cuts a long query to 3/4 of max_length; pergola keeps the query whole (refusing one that leaves
  no room) and cuts the document only, so pairs under the limit get identical ids.

Both yes/no prompts also serve a decoder converted to sequence classification (a `score` head over
the last token, e.g. tomaarsen/Qwen3-Reranker-0.6B-seq-cls) when `rerank_prompt` names them;
a decoder ForSequenceClassification folder otherwise gets the tokenizer's pair template, as
`tokenizer(query, document)` does. A causal LM takes its prompt from its architecture (Qwen3:
qwen3-reranker, Qwen2: mxbai-rerank-v2) or from the answer tokens of its sentence-transformers
LogitScore module ("no"/"yes" or "0"/"1"); the folder's chat template is not rendered.
sigmoid(logit(yes) - logit(no)) = softmax([no, yes])[yes].

Tokenization is batched through HF `tokenizers`; the only Python loop gathers ids into flat arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import ModelSpec
from pergola.config.reranker import (
    ANSWER_WORDS,
    RERANK_KINDS,
    AnswerIds,
    RerankKind,
    answer_ids,
    reranker_kind,
    yes_no_head,
)
from pergola.text.errors import RequestError, StringLimits, read_strings
from pergola.text.tokenization import Template, cut, truncate_mode, window

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANKER_MAX_LENGTH = 8192  # the official reference's max_length (mxbai-rerank-v2's too)

# mixedbread-ai/mxbai-rerank-v2, as its official package (mxbai_rerank_v2.py) writes it.
MXBAI_PREFIX = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                "<|im_end|>\n<|im_start|>user\n")
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
MXBAI_SEP = "\n"
MXBAI_TASK = ("You are a search relevance expert who evaluates how well documents match search queries. For each "
              "query-document pair, carefully analyze the semantic relationship between them, then provide your "
              "binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:")
MXBAI_DOCUMENT_HEAD = "document:"  # the document part is "document: {document}"


def mxbai_query(instruction: str, query: str) -> str:
    """The query part: "instruction: ...\\nquery: ..." (no instruction: "query: ...")."""
    return (f"instruction: {instruction}{MXBAI_SEP}" if instruction else "") + f"query: {query}"


def qwen3_reranker_body(instruction: str, query: str, document: str) -> str:
    """The official `format_instruction(instruction, query, doc)`."""
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def pair_max_length(spec: ModelSpec, kind: RerankKind | None = None) -> int:
    """Tokens a (query, document) pair may hold, its prompt included: the folder's
    max_seq_length, and for the yes/no prompts at most QWEN3_RERANKER_MAX_LENGTH."""
    kind = kind or reranker_kind(spec)
    return min(spec.max_seq_length, QWEN3_RERANKER_MAX_LENGTH) if kind in ANSWER_WORDS else spec.max_seq_length


@dataclass(frozen=True)
class RerankEncoded:
    input_ids: np.ndarray  # [num_tokens] int64: every pair's ids, concatenated
    lengths: np.ndarray  # [num_documents] int32: tokens per pair (its slice of input_ids)
    token_type_ids: np.ndarray  # [num_tokens] int64: segment ids (cross-encoder: 0 query, 1 document)
    truncated: np.ndarray  # [num_documents] bool: the document was cut


class RerankTokenizer:
    """Turns one rerank request (a query and its documents) into flat token ids.

    Documents are tokenized without special tokens, cut in numpy (`pergola.text.tokenization.cut`:
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
        Default: the folder's max_seq_length, and for the yes/no prompts at most 8192, as in the
        official references. kind: the folder's (`reranker_kind`) unless given. instruction: the
        default of requests that send none (yes/no prompts only; qwen3-reranker's default is the
        web-search one, mxbai-rerank-v2's none)."""
        kind = kind or reranker_kind(spec)
        if kind not in RERANK_KINDS:
            raise ValueError(f"kind must be one of {RERANK_KINDS}, got {kind!r}")
        if kind == "cross-encoder" and instruction is not None:
            raise ValueError(f"an instruction only applies to the yes/no prompts {tuple(ANSWER_WORDS)}")
        self.spec = spec
        self.kind = kind
        config = config or EngineConfig(model_dir=str(spec.path))
        self.limits, self.query_limits = config.document_limits(), config.query_limits()
        self.max_length = int(max_length if max_length is not None else pair_max_length(spec, kind))
        if instruction is None:
            instruction = QWEN3_RERANKER_INSTRUCTION if kind == "qwen3-reranker" else ""
        self.instruction = instruction
        self.answer_ids: AnswerIds | None = None  # a causal LM's yes/no: the tokens its score is read from

        self._whole = Tokenizer.from_file(str(spec.tokenizer_file))
        self._whole.no_padding()
        self._whole.no_truncation()

        if kind == "cross-encoder":
            self.template = Template.probe(self._whole, pair=True)
            if self.template.added + 1 >= self.max_length:
                raise ValueError(f"max_length {self.max_length} leaves no room for a query and a document")
        else:
            if kind == "qwen3-reranker":
                self.template = Template.probe(self._whole)
                prefix, suffix = [QWEN3_RERANKER_PREFIX], [QWEN3_RERANKER_SUFFIX]
            else:  # mxbai-rerank-v2: no special tokens of the tokenizer's own, each part tokenized alone
                self.template = Template(parts=(np.zeros(0, np.int64),) * 2, part_types=(np.zeros(0, np.int64),) * 2,
                                         sequence_types=(0,))
                prefix, suffix = [MXBAI_PREFIX], [MXBAI_SEP, MXBAI_TASK, MXBAI_SUFFIX]
                self.sep_ids = self._ids(MXBAI_SEP)
            self.prefix_ids = np.concatenate([self._ids(t) for t in prefix])
            self.suffix_ids = np.concatenate([self._ids(t) for t in suffix])
            # the body's own tokens (its post-processor's, if any, come out of it as with HF's truncation)
            self.body_budget = self.max_length - len(self.prefix_ids) - len(self.suffix_ids) - self.template.added
            if self.body_budget < 2:
                raise ValueError(f"max_length {self.max_length} leaves no room for the reranker prompt")
            if yes_no_head(spec):
                self.answer_ids = answer_ids(spec, self._whole, kind)

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self._whole.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def read_request(self, query: str | bytes, documents: list[str | bytes]) -> tuple[str, list[str]]:
        """The query and documents decoded and checked against the limits, before any tokenization."""
        [query] = read_strings([query], "QUERY", "query", self.query_limits)
        return query, read_strings(documents, "DOCUMENTS", "document", self.limits, used_chars=len(query))

    def _read_instruction(self, instruction: str | bytes | None, query: str) -> str:
        """The request's INSTRUCTION (counted with the query against max_query_chars), or the default."""
        if instruction is None:
            return self.instruction
        if self.kind not in ANSWER_WORDS:
            raise RequestError("INSTRUCTION applies to Qwen3-Reranker models and the other yes/no rerankers "
                               "(mxbai-rerank-v2); this cross-encoder takes none: leave it out")
        limits = StringLimits(1, self.query_limits.max_chars, self.query_limits.max_chars, "max_query_chars")
        [text] = read_strings([instruction], "INSTRUCTION", "instruction", limits, used_chars=len(query))
        return text

    def _query_too_long(self, used: int, room: int) -> RequestError:
        what = "the instruction and query take" if self.kind in ANSWER_WORDS else "the query takes"
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
        if self.kind == "mxbai-rerank-v2":
            return self._encode_mxbai(query, documents, mode, max_document_tokens, instruction)
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


    def _encode_mxbai(self, query: str, documents: list[str], mode: str, max_document_tokens: int | None,
                      instruction: str) -> RerankEncoded:
        # prefix | query part | sep | "document: ..." | sep task suffix; the document part keeps its
        # "document:" head whatever the cut (the pre-tokenizer splits there: a space always follows).
        q = self._ids(mxbai_query(instruction, query))
        head_len = len(self._ids(MXBAI_DOCUMENT_HEAD))
        extra = len(self.prefix_ids) + len(q) + len(self.sep_ids) + len(self.suffix_ids)
        budget = self.max_length - extra
        if head_len + 1 > budget:
            raise self._query_too_long(extra, self.max_length)
        if max_document_tokens:
            budget = min(budget, head_len + max_document_tokens)
        ids, truncated = self._cut([f"{MXBAI_DOCUMENT_HEAD} {doc}" for doc in documents], mode, head_len, budget,
                                   extra, max_document_tokens)
        parts: list[np.ndarray] = []
        for x in ids:
            parts += (self.prefix_ids, q, self.sep_ids, x, self.suffix_ids)
        input_ids = np.concatenate(parts)
        lengths = np.fromiter((len(x) + extra for x in ids), dtype=np.int32, count=len(ids))
        return RerankEncoded(input_ids=input_ids, lengths=lengths,
                             token_type_ids=np.zeros(len(input_ids), dtype=np.int64), truncated=truncated)


@dataclass(frozen=True)
class RerankOptions:
    """What a rerank request asks of its answer: TOP_N, how many indices to list (0: all documents);
    RAW_SCORES, the logits (cross-encoder: the classifier's; yes/no LMs: logit(yes) - logit(no))
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
