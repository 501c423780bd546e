"""What the routes ask of Triton: embeddings of texts or token ids, rerank scores, class
probabilities; each request
cut into chunks that run concurrently on the replicas and are put back together in order.

A chunk is at most `chunk_texts` texts and `chunk_chars` characters (a longer text is a chunk of
its own). A text's result never depends on how it was cut: the engine computes every sequence
on its own (ragged batches), which tests/test_gateway.py checks against unsplit answers.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence, TypeVar

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput

from pergola.admin import API_KEY_HEADER, GRPC_API_KEY_HEADER
from pergola.classify import ClassifyTokenizer
from pergola.errors import RequestError
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import GatewayError, refused
from pergola.gateway.metrics import INPUTS
from pergola.gateway.offload import TokenIds
from pergola.gateway.replicas import Replica, ReplicaPool
from pergola.gateway.tokenizers import LocalTokenizers
from pergola.gateway.tracing import triton_call
from pergola.gateway.triton_http import Tensor
from pergola.rerank import RerankTokenizer
from pergola.token_outputs import TOKEN_OUTPUT_TYPES
from pergola.tokenization import TextTokenizer

# Triton ENCODING -> (output tensor, numpy dtype of its values); FP16 travels as UINT16 bits.
OUTPUTS = {
    "float32": ("EMBEDDING", np.float32),
    "float16": ("EMBEDDING_FP16", np.float16),
    "int8": ("EMBEDDING_INT8", np.int8),
    "binary": ("EMBEDDING_BINARY", np.uint8),
}


@dataclass(frozen=True)
class EmbedOptions:
    prompt_name: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    max_tokens: int | None = None  # a limit below the model's
    encoding: str = "float32"  # a key of OUTPUTS


@dataclass(frozen=True)
class RerankOptions:
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    max_document_tokens: int | None = None
    instruction: str | None = None  # a Qwen3-Reranker's task instruction
    raw_scores: bool = False  # logits instead of their sigmoid


@dataclass(frozen=True)
class ClassifyOptions:
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    raw_scores: bool = False  # logits instead of probabilities


@dataclass
class Embedded:
    vectors: np.ndarray  # [n, dim] of OUTPUTS[encoding]'s dtype ([n, ceil(dim / 8)] for binary)
    tokens: np.ndarray  # [n] int: tokens per input after truncation


@dataclass
class PerToken:
    """bge-m3's per-token outputs of each text (pergola.token_outputs), in input order."""

    sparse: list[tuple[np.ndarray, np.ndarray]]  # (token ids ascending, their weights) per text, when asked
    colbert: list[np.ndarray]  # [tokens - 1, dim] fp32 per text (every token but CLS), when asked
    tokens: np.ndarray  # [n] int: tokens per input after truncation


def _split(values: list[np.ndarray], offsets: np.ndarray) -> list[list[np.ndarray]]:
    """Ragged answer -> one slice per text of each of `values` (offsets [n + 1]; [0]: not asked)."""
    return [[v[a:b] for v in values] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


# bge-m3's per-token outputs (pergola.token_outputs) and, from the ensemble, each text's tokens
_PER_TOKEN = [*TOKEN_OUTPUT_TYPES, "TOKEN_COUNT"]


def _per_token_answer(r, tokens: np.ndarray) -> PerToken:
    """A Triton answer's ragged SPARSE_* / TOKEN_* cut per text."""
    sparse = _split([r.as_numpy("SPARSE_INDICES"), r.as_numpy("SPARSE_VALUES")], r.as_numpy("SPARSE_OFFSETS"))
    colbert = _split([r.as_numpy("TOKEN_EMBEDDINGS")], r.as_numpy("TOKEN_OFFSETS"))
    return PerToken([tuple(s) for s in sparse], [c[0] for c in colbert], tokens)


@dataclass
class Reranked:
    scores: np.ndarray  # [n] float32, in input order
    tokens: np.ndarray  # [n] int: tokens per (query, document) pair after truncation


@dataclass
class Classified:
    probs: np.ndarray  # [n, labels] float32, in input order (the logits with raw_scores)
    labels: list[str]  # the label of each column
    tokens: np.ndarray  # [n] int: tokens per input after truncation


def _classified(result, tokens: np.ndarray) -> Classified:
    """A Triton answer's PROBS and LABELS."""
    labels = [label.decode("utf-8") for label in result.as_numpy("LABELS").reshape(-1)]
    return Classified(result.as_numpy("PROBS"), labels, tokens)


@dataclass
class Tokenized:
    ids: np.ndarray  # [num_tokens] int64, every text's tokens in order
    lengths: np.ndarray  # [n] int32: tokens per text
    pieces: np.ndarray  # [num_tokens] bytes: each token's text (UTF-8)
    offsets: np.ndarray  # [num_tokens, 2] int32: characters [start, stop) in its text, -1 for special tokens


# The tokenizer models' refusal of a text over the token limit with truncation off
_TOO_LONG = re.compile(r"(?:TEXT|DOCUMENTS)\[(\d+)\] (?:has more than \d+ tokens|with the query is \d+ tokens), "
                       r"over this (?:model's|request's) limit of (\d+)")


class TooLong(GatewayError):
    """Input `index` of the request (not of its chunk) is over `limit` tokens and truncation is
    off; each route words it for its API (TEI answers 413, OpenAI and Cohere 400)."""

    def __init__(self, index: int, limit: int, message: str) -> None:
        super().__init__(400, message)
        self.index, self.limit = index, limit


T = TypeVar("T")
E = TypeVar("E")  # an encoding made by one of the gateway's tokenizers


def _too_long(error: GatewayError, start: int = 0) -> GatewayError:
    """A tokenizer's refusal as TooLong when it is one (naming input `start` + its index), else itself."""
    found = _TOO_LONG.search(error.message)
    return error if found is None else TooLong(start + int(found[1]), int(found[2]), error.message)


def _id_inputs(enc: Any, token_types: bool = False, raw_scores: bool = False) -> list[Tensor]:
    """An encoding made here as NAME_encoder's inputs: [1, T] ids, [1, n] lengths, the token types
    (pairs), RAW_SCORES when asked."""
    inputs = [Tensor("INPUT_IDS", enc.input_ids[None, :], "INT64"), Tensor("LENGTHS", enc.lengths[None, :], "INT32")]
    if token_types:
        inputs.append(Tensor("TOKEN_TYPE_IDS", enc.token_type_ids[None, :], "INT64"))
    if raw_scores:
        inputs.append(Tensor("RAW_SCORES", np.array([[True]]), "BOOL"))
    return inputs


def _truncate(model: ServedModel, asked: str | None) -> str:
    """The request's truncation, else the served model's default."""
    return asked if asked is not None else model.limit("truncate")


async def _numbered(start: int, call: Awaitable[T]) -> T:
    """A chunk's call; a too-long refusal names the request's input, not the chunk's."""
    try:
        return await call
    except GatewayError as e:
        raise _too_long(e, start) from None


async def _all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """The results of `calls`, run concurrently; one call is awaited as it is (a query's request is
    one chunk: no task to create and schedule; with the flattening in embed_tokens, 96 -> 47 us of
    the gateway's CPU for a 128-id request, Triton's answer canned, on the 2-core CPU host)."""
    calls = list(calls)
    return [await calls[0]] if len(calls) == 1 else list(await asyncio.gather(*calls))


def chunks(sizes: Sequence[int], max_items: int, max_size: int) -> list[tuple[int, int]]:
    """[start, end) ranges over items of `sizes`: at most max_items items and max_size in total
    (an item over max_size alone)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_items or total + size > max_size):
            out.append((start, i))
            start, total = i, 0
        total += size
    if sizes:
        out.append((start, len(sizes)))
    return out


def _grpc_input(tensor: Tensor) -> InferInput:
    grpc_input = InferInput(tensor.name, list(tensor.array.shape), tensor.datatype)
    grpc_input.set_data_from_numpy(tensor.array)
    return grpc_input


def _option_inputs(opts: EmbedOptions, shape: list[int]) -> list[Tensor]:
    """The optional embed inputs a request sets ([1] for the ensemble, [1, 1] for an encoder)."""
    inputs = []
    if opts.prompt_name is not None:
        inputs.append(Tensor("PROMPT_NAME", np.array([opts.prompt_name.encode()], dtype=object), "BYTES"))
    if opts.truncate is not None:
        inputs.append(Tensor("TRUNCATE_MODE", np.array([opts.truncate.encode()], dtype=object), "BYTES"))
    if opts.max_tokens is not None:
        inputs.append(Tensor("MAX_TOKENS", np.array([opts.max_tokens], dtype=np.int32), "INT32"))
    return inputs + _encoder_options(opts, shape)


def _encoder_options(opts: EmbedOptions, shape: list[int]) -> list[Tensor]:
    """The embed options that reach the encoder (the tokenizer applies the others)."""
    inputs = []
    if opts.dimensions is not None:
        inputs.append(Tensor("DIMENSIONS", np.array([opts.dimensions], dtype=np.int32).reshape(shape), "INT32"))
    if opts.normalize is not None:
        inputs.append(Tensor("NORMALIZE", np.array([opts.normalize], dtype=bool).reshape(shape), "BOOL"))
    if opts.encoding != "float32":  # (left out otherwise: the plain request of older servers)
        inputs.append(Tensor("ENCODING", np.array([opts.encoding.encode()], dtype=object).reshape(shape), "BYTES"))
    return inputs


class Backend:
    def __init__(self, pool: ReplicaPool, chunk_texts: int, chunk_chars: int, timeout_s: float,
                 api_key: str | None = None, tokenizers: LocalTokenizers | None = None) -> None:
        self.pool = pool
        self.tokenizers = tokenizers or LocalTokenizers(None, 0)
        self.chunk_texts, self.chunk_chars = chunk_texts, chunk_chars
        self.timeout_s = timeout_s
        # Triton's inference is behind the first key when `pergola serve --api-key` started it
        self.http_headers = {API_KEY_HEADER: api_key} if api_key else None
        self.grpc_headers = {GRPC_API_KEY_HEADER: api_key} if api_key else None

    async def _encoded_here(self, texts: list[str], encode: Callable[[], E]) -> E:
        """The gateway's own tokenizing of `texts` (gateway/tokenizers.py: on the loop or a
        thread, by size); a refusal comes back as Triton's would."""
        try:
            return await self.tokenizers.run(sum(map(len, texts)), encode)
        except RequestError as e:
            raise _too_long(refused(str(e))) from None

    async def _infer(self, model: str, inputs: list[Tensor], outputs: list[str], version: str = ""):
        """One Triton call on the least busy replica (another one if it is busy or gone), over its
        HTTP port when known (gateway/triton_http.py), else gRPC; the answer reads as_numpy(name)."""

        async def call(replica: Replica):
            # Triton is told the deadline too (µs): the encoder drops work nobody waits for.
            if replica.http is not None:
                with triton_call(model, self.http_headers, "http") as headers:  # (gateway/tracing.py)
                    return await replica.http.infer(model, inputs, outputs, version, self.timeout_s, headers)
            with triton_call(model, self.grpc_headers, "grpc") as headers:
                return await replica.client.infer(
                    model, [_grpc_input(t) for t in inputs], model_version=version,
                    outputs=[InferRequestedOutput(name) for name in outputs], client_timeout=self.timeout_s,
                    timeout=int(self.timeout_s * 1e6), headers=headers)

        return await self.pool.call(call)

    async def embed(self, model: ServedModel, texts: list[str], opts: EmbedOptions) -> Embedded:
        """Embeddings of `texts`: tokenized here when short (gateway/tokenizers.py), else through
        the embed ensemble in chunks."""
        return await self._here_or_ensemble(model, texts, lambda tok: self._embed_here(model, tok, texts, opts),
                                            lambda: self._embed_ensemble(model, texts, opts))

    async def _here_or_ensemble(self, model: ServedModel, texts: list[str],
                                here: Callable[[Any], Awaitable[T]], ensemble: Callable[[], Awaitable[T]]) -> T:
        """here(tokenizer) when the gateway tokenizes `texts` itself, else ensemble(); a version
        swapped out since the catalog was read (404) takes the ensemble, which serves the new one."""
        tokenizer = self.tokenizers.for_request(model, texts)
        if tokenizer is not None:
            try:
                result = await here(tokenizer)
                INPUTS.labels(model.task, "gateway").inc(len(texts))
                return result
            except GatewayError as e:
                if e.status != 404:  # (404: that version is gone, swapped by `pergola add-version`)
                    raise
                self.tokenizers.stale(model)
        INPUTS.labels(model.task, "triton").inc(len(texts))
        return await ensemble()

    async def _tokenized_here(self, model: ServedModel, tokenizer: TextTokenizer, texts: list[str],
                              opts: EmbedOptions) -> tuple[list[Tensor], np.ndarray]:
        """`texts` tokenized as NAME_tokenizer would -> NAME_encoder's inputs and each text's tokens."""
        enc = await self._encoded_here(texts, lambda: tokenizer.encode(
            texts, prompt_name=opts.prompt_name, max_tokens=opts.max_tokens, truncate=_truncate(model, opts.truncate)))
        inputs = _id_inputs(enc)
        if enc.prompt_lengths.any():
            inputs.append(Tensor("PROMPT_LENGTHS", enc.prompt_lengths[None, :], "INT32"))
        return inputs + _encoder_options(opts, [1, 1]), enc.lengths

    async def _embed_here(self, model: ServedModel, tokenizer: TextTokenizer, texts: list[str],
                          opts: EmbedOptions) -> Embedded:
        """`texts` tokenized here, their ids to the same version of NAME_encoder."""
        output, dtype = OUTPUTS[opts.encoding]
        inputs, tokens = await self._tokenized_here(model, tokenizer, texts, opts)
        result = await self._infer(f"{model.target}_encoder", inputs, [output], version=model.version or "")
        return Embedded(result.as_numpy(output).view(dtype), tokens)

    async def _embed_ensemble(self, model: ServedModel, texts: list[str], opts: EmbedOptions) -> Embedded:
        output, dtype = OUTPUTS[opts.encoding]

        async def one(start: int, end: int) -> Embedded:
            data = np.array([t.encode("utf-8") for t in texts[start:end]], dtype=object)
            inputs = [Tensor("TEXT", data, "BYTES"), *_option_inputs(opts, [1])]
            result = await self._infer(model.name, inputs, [output, "TOKEN_COUNT"])
            return Embedded(result.as_numpy(output).view(dtype), result.as_numpy("TOKEN_COUNT"))

        spans = chunks([len(t) for t in texts], self.chunk_texts, self.chunk_chars)
        parts = await _all(_numbered(a, one(a, b)) for a, b in spans)
        return Embedded(np.concatenate([p.vectors for p in parts]), np.concatenate([p.tokens for p in parts]))

    async def per_token(self, model: ServedModel, texts: list[str], outputs: list[str],
                        opts: EmbedOptions = EmbedOptions()) -> PerToken:
        """bge-m3's `outputs` (sparse, colbert) of `texts`: tokenized here when short, else from
        the embed ensemble's OUTPUTS in chunks."""
        asked = np.array([o.encode() for o in outputs], dtype=object)

        async def here(tokenizer: TextTokenizer) -> PerToken:
            inputs, tokens = await self._tokenized_here(model, tokenizer, texts, opts)
            r = await self._infer(f"{model.target}_encoder", [*inputs, Tensor("OUTPUTS", asked[None, :], "BYTES")],
                                  _PER_TOKEN[:-1], version=model.version or "")
            return _per_token_answer(r, tokens)

        async def one(start: int, end: int) -> PerToken:
            data = np.array([t.encode("utf-8") for t in texts[start:end]], dtype=object)
            inputs = [Tensor("TEXT", data, "BYTES"), Tensor("OUTPUTS", asked, "BYTES"), *_option_inputs(opts, [1])]
            r = await self._infer(model.name, inputs, _PER_TOKEN)
            return _per_token_answer(r, r.as_numpy("TOKEN_COUNT"))

        async def ensemble() -> PerToken:
            spans = chunks([len(t) for t in texts], self.chunk_texts, self.chunk_chars)
            parts = await _all(_numbered(a, one(a, b)) for a, b in spans)
            return PerToken([s for p in parts for s in p.sparse], [c for p in parts for c in p.colbert],
                            np.concatenate([p.tokens for p in parts]))

        return await self._here_or_ensemble(model, texts, here, ensemble)

    async def embed_tokens(self, model: ServedModel, ids: TokenIds, opts: EmbedOptions) -> Embedded:
        """Pre-tokenized input, straight to NAME_encoder (no prompt, no truncation there)."""
        output, dtype = OUTPUTS[opts.encoding]
        offsets = ids.offsets()

        async def one(start: int, end: int) -> np.ndarray:
            inputs = [Tensor("INPUT_IDS", ids.flat[None, offsets[start]:offsets[end]], "INT64"),
                      Tensor("LENGTHS", ids.lengths[None, start:end], "INT32"), *_option_inputs(opts, [1, 1])]
            result = await self._infer(f"{model.target}_encoder", inputs, [output])
            return result.as_numpy(output).view(dtype)

        parts = await _all(one(a, b) for a, b in chunks(ids.lengths.tolist(), self.chunk_texts, self.chunk_chars))
        return Embedded(np.concatenate(parts), ids.lengths)

    async def tokenize(self, model: ServedModel, texts: list[str], prompt_name: str | None,
                       add_special_tokens: bool) -> Tokenized:
        """Every token of `texts` as NAME_tokenizer makes them (asked for TOKEN_TEXT: untruncated)."""
        options = [Tensor("ADD_SPECIAL_TOKENS", np.array([add_special_tokens], dtype=bool), "BOOL")]
        if prompt_name is not None:
            options.append(Tensor("PROMPT_NAME", np.array([prompt_name.encode()], dtype=object), "BYTES"))
        outputs = ["INPUT_IDS", "LENGTHS", "TOKEN_TEXT", "TOKEN_OFFSETS"]

        async def one(start: int, end: int) -> Tokenized:
            data = np.array([t.encode("utf-8") for t in texts[start:end]], dtype=object)
            result = await self._infer(f"{model.target}_tokenizer", [Tensor("TEXT", data, "BYTES"), *options], outputs)
            return Tokenized(*(result.as_numpy(name)[0] for name in outputs))

        parts = await _all(one(a, b) for a, b in chunks([len(t) for t in texts], self.chunk_texts, self.chunk_chars))
        return Tokenized(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("ids", "lengths", "pieces",
                                                                                     "offsets")))

    async def rerank(self, model: ServedModel, query: str, documents: list[str],
                     opts: RerankOptions = RerankOptions()) -> Reranked:
        """Scores [n] float32 of `documents` against `query` and each pair's tokens, in input order:
        tokenized here when the request is short (gateway/tokenizers.py), else through the
        rerank ensemble in chunks."""
        return await self._here_or_ensemble(
            model, [query, *documents], lambda tok: self._rerank_here(model, tok, query, documents, opts),
            lambda: self._rerank_ensemble(model, query, documents, opts))

    async def _rerank_here(self, model: ServedModel, tokenizer: RerankTokenizer, query: str, documents: list[str],
                           opts: RerankOptions) -> Reranked:
        """The pairs tokenized as NAME_tokenizer would, their ids to the same version of NAME_encoder."""
        enc = await self._encoded_here([query, *documents], lambda: tokenizer.encode(
            query, documents, max_document_tokens=opts.max_document_tokens, instruction=opts.instruction,
            truncate=_truncate(model, opts.truncate)))
        inputs = _id_inputs(enc, token_types=True, raw_scores=opts.raw_scores)
        result = await self._infer(f"{model.target}_encoder", inputs, ["SCORE"], version=model.version or "")
        return Reranked(result.as_numpy("SCORE"), enc.lengths)

    async def _rerank_ensemble(self, model: ServedModel, query: str, documents: list[str],
                               opts: RerankOptions) -> Reranked:
        options = [Tensor("QUERY", np.array([query.encode("utf-8")], dtype=object), "BYTES")]
        if opts.truncate is not None:
            options.append(Tensor("TRUNCATE_MODE", np.array([opts.truncate.encode()], dtype=object), "BYTES"))
        if opts.max_document_tokens is not None:
            options.append(Tensor("MAX_DOCUMENT_TOKENS", np.array([opts.max_document_tokens], dtype=np.int32),
                                   "INT32"))
        if opts.instruction is not None:
            options.append(Tensor("INSTRUCTION", np.array([opts.instruction.encode("utf-8")], dtype=object), "BYTES"))
        if opts.raw_scores:
            options.append(Tensor("RAW_SCORES", np.array([True]), "BOOL"))

        async def one(start: int, end: int) -> Reranked:
            docs = np.array([d.encode("utf-8") for d in documents[start:end]], dtype=object)
            result = await self._infer(model.name, [*options, Tensor("DOCUMENTS", docs, "BYTES")],
                                       ["SCORE", "TOKEN_COUNT"])
            return Reranked(result.as_numpy("SCORE"), result.as_numpy("TOKEN_COUNT"))

        sizes = [len(d) + len(query) for d in documents]
        parts = await _all(_numbered(a, one(a, b)) for a, b in chunks(sizes, self.chunk_texts, self.chunk_chars))
        return Reranked(np.concatenate([p.scores for p in parts]), np.concatenate([p.tokens for p in parts]))

    async def classify(self, model: ServedModel, texts: list[str], pairs: list[str | None] | None = None,
                       opts: ClassifyOptions = ClassifyOptions()) -> Classified:
        """Class probabilities [n, labels] of `texts` (pairs[i]: text i's second sequence, None for
        none), in input order: tokenized here when the request is short (gateway/tokenizers.py),
        else through the classify ensemble in chunks. Single texts and pairs go in separate calls
        (TEXT_PAIR pairs all of a call's texts)."""
        pairs = pairs or [None] * len(texts)
        groups = [[i for i, p in enumerate(pairs) if p is None], [i for i, p in enumerate(pairs) if p is not None]]
        options = [Tensor("RAW_SCORES", np.array([True]), "BOOL")] if opts.raw_scores else []
        if opts.truncate is not None:
            options.append(Tensor("TRUNCATE_MODE", np.array([opts.truncate.encode()], dtype=object), "BYTES"))

        async def one(index: list[int], paired: bool) -> Classified:
            inputs = [*options, Tensor("TEXT", np.array([texts[i].encode("utf-8") for i in index], dtype=object),
                                        "BYTES")]
            if paired:
                inputs.append(Tensor("TEXT_PAIR", np.array([pairs[i].encode("utf-8") for i in index],  # type: ignore[union-attr]
                                                             dtype=object), "BYTES"))
            result = await self._infer(model.name, inputs, ["PROBS", "LABELS", "TOKEN_COUNT"])
            return _classified(result, result.as_numpy("TOKEN_COUNT"))

        def one_here(tokenizer: ClassifyTokenizer) -> Callable[[list[int], bool], Awaitable[Classified]]:
            async def call(index: list[int], paired: bool) -> Classified:
                chosen = [texts[i] for i in index]
                second = [pairs[i] for i in index] if paired else None
                enc = await self._encoded_here([*chosen, *(second or [])], lambda: tokenizer.encode(
                    chosen, second, truncate=_truncate(model, opts.truncate)))
                inputs = _id_inputs(enc, token_types=True, raw_scores=opts.raw_scores)
                result = await self._infer(f"{model.target}_encoder", inputs, ["PROBS", "LABELS"],
                                           version=model.version or "")
                return _classified(result, enc.lengths)
            return call

        async def numbered(call, index: list[int], paired: bool) -> tuple[list[int], Classified]:
            try:
                return index, await _numbered(0, call(index, paired))
            except TooLong as e:  # name the request's input, not the call's
                raise TooLong(index[e.index], e.limit, e.message) from None

        async def assembled(calls: list[Awaitable[tuple[list[int], Classified]]]) -> Classified:
            parts = await _all(calls)
            labels = parts[0][1].labels
            probs = np.empty((len(texts), len(labels)), dtype=np.float32)
            tokens = np.empty(len(texts), dtype=np.int64)
            for index, part in parts:
                probs[index], tokens[index] = part.probs, part.tokens
            return Classified(probs, labels, tokens)

        return await self._here_or_ensemble(
            model, [*texts, *(p for p in pairs if p is not None)],
            lambda tok: assembled([numbered(one_here(tok), group, bool(paired))
                                   for paired, group in enumerate(groups) if group]),
            lambda: assembled([numbered(one, group[a:b], bool(paired)) for paired, group in enumerate(groups)
                               for a, b in chunks([len(texts[i]) + len(pairs[i] or "") for i in group],
                                                  self.chunk_texts, self.chunk_chars)]))
