"""What the routes ask of Triton: embeddings of texts or token ids, rerank scores, class
probabilities; each request admitted first (admission.py: 429 or 413 before any work), then cut
into chunks that run concurrently on the replicas and are put back together in order.

A chunk is at most `chunk_texts` texts and `chunk_chars` characters (a longer text is a chunk of
its own); at most `chunk_window` chunks of a request per replica are in flight, and the first one
to fail cancels the others. A text's result never depends on how it was cut: the engine computes
every sequence on its own (ragged batches), which tests/test_gateway.py checks against unsplit
answers.

A call of more than CANCELLABLE_TOKENS goes to NAME_encoder over gRPC, so that a request given
up on (its client gone, a chunk refused) stops its work in Triton: a chunk of texts is then
tokenized by NAME_tokenizer (or here) and its ids sent to NAME_encoder, not through the ensemble,
whose step in flight Triton does not cancel (catalog.Pipeline). Smaller calls go over HTTP, which
costs the gateway less CPU (triton_http.py) and Triton at most one CPU step if given up on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import np_to_triton_dtype

from pergola.gateway.admission import Admission, Ticket, lengths, refused_later, watch_client
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import GatewayError, refused
from pergola.gateway.metrics import INPUTS
from pergola.gateway.offload import TokenIds
from pergola.gateway.replicas import Replica, ReplicaPool
from pergola.gateway.tokenizers import LocalTokenizers
from pergola.gateway.tracing import triton_call
from pergola.gateway.triton_http import Tensor
from pergola.outputs.token_outputs import TOKEN_OUTPUT_TYPES
from pergola.text.classify import ClassifyTokenizer
from pergola.text.encodings import check_encoding, quantize
from pergola.text.errors import RequestError
from pergola.text.rerank import RerankTokenizer
from pergola.text.tokenization import Chunks, Encoded, TextTokenizer, check_windows
from pergola.triton.adapter import ADMITTED
from pergola.triton.admin import API_KEY_HEADER, GRPC_API_KEY_HEADER

# A call of more tokens than this goes over gRPC, cancellable (module docstring): about one forward
# step on a CPU (1,024 tokens, ~0.3 s), under a millisecond on a GPU: what is lost if it runs anyway.
CANCELLABLE_TOKENS = 1_024
# Triton ENCODING -> (output tensor, numpy dtype of its values); FP16 travels as UINT16 bits.
OUTPUTS = {
    "float32": ("EMBEDDING", np.float32),
    "float16": ("EMBEDDING_FP16", np.float16),
    "int8": ("EMBEDDING_INT8", np.int8),
    "binary": ("EMBEDDING_BINARY", np.uint8),
}


@dataclass(frozen=True)
class EmbedRequest:
    prompt_name: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    max_tokens: int | None = None  # a limit below the model's
    encoding: str = "float32"  # a key of OUTPUTS


@dataclass(frozen=True)
class Chunking:
    """A request's `chunking` (docs/long-documents.md, pergola.text.chunking): windows of `tokens` text
    tokens (None: the most the model takes), neighbours sharing `overlap`, pooled `each` (a vector
    per window), `mean` (one per input) or `late` (a vector per window from the text's one encoding)."""

    tokens: int | None = None
    overlap: int = 0
    pooling: str = "each"


@dataclass
class ChunkedEmbedded:
    vectors: np.ndarray  # [k, dim] a row per chunk (each, late) or [n, dim] per input (mean), OUTPUTS[encoding]'s dtype
    chunks: np.ndarray  # [n] int: chunks of each input
    spans: np.ndarray  # [k, 2] int: each chunk's characters [start, end) in its input
    tokens: np.ndarray  # [n] int: tokens encoded for each input (its windows', special tokens included)


@dataclass(frozen=True)
class RerankRequest:
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    max_document_tokens: int | None = None
    instruction: str | None = None  # a Qwen3-Reranker's task instruction
    raw_scores: bool = False  # logits instead of their sigmoid


@dataclass(frozen=True)
class ClassifyRequest:
    truncate: str | None = None  # NONE | START | END (None: the model's default)
    raw_scores: bool = False  # logits instead of probabilities


@dataclass
class Embedded:
    vectors: np.ndarray  # [n, dim] of OUTPUTS[encoding]'s dtype ([n, ceil(dim / 8)] for binary)
    tokens: np.ndarray  # [n] int: tokens per input after truncation


@dataclass
class PerToken:
    """bge-m3's per-token outputs of each text (pergola.outputs.token_outputs), in input order."""

    sparse: list[tuple[np.ndarray, np.ndarray]]  # (token ids ascending, their weights) per text, when asked
    colbert: list[np.ndarray]  # [tokens - 1, dim] fp32 per text (every token but CLS), when asked
    tokens: np.ndarray  # [n] int: tokens per input after truncation


def _split(values: list[np.ndarray], offsets: np.ndarray) -> list[list[np.ndarray]]:
    """Ragged answer -> one slice per text of each of `values` (offsets [n + 1]; [0]: not asked)."""
    return [[v[a:b] for v in values] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


# bge-m3's per-token outputs (pergola.outputs.token_outputs) and, from the ensemble, each text's tokens
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


# NAME_tokenizer's answer to a `chunking` request (CHUNK_SIZE)
_CHUNK_OUTPUTS = ["INPUT_IDS", "LENGTHS", "PROMPT_LENGTHS", "NORMALIZE_OUT", "CHUNK_COUNTS", "CHUNK_SEQUENCES",
                  "CHUNK_TEXT_SPANS", "CHUNK_LENGTHS", "CHUNK_SPANS"]
_TEXT_INDEX = re.compile(r"TEXT\[(\d+)\]")


def weighted_means(vectors: np.ndarray, weights: np.ndarray, firsts: np.ndarray, normalize: bool) -> np.ndarray:
    """`mean` pooling: each text's windows' vectors ([k, d] fp32, a text's from firsts[i] on)
    averaged with their tokens as weights (a window of none weighs 1), normalised when asked:
    [n, d] fp32."""
    w = np.maximum(weights, 1).astype(np.float64)
    out = np.add.reduceat(vectors * w[:, None], firsts, axis=0) / np.add.reduceat(w, firsts)[:, None]
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out.astype(np.float32)


async def _renumbered(start: int, call: Awaitable[T]) -> T:
    """A chunk's call; a refusal naming its TEXT[i] names the request's TEXT[start + i]."""
    try:
        return await call
    except GatewayError as e:
        e.message = _TEXT_INDEX.sub(lambda m: f"TEXT[{start + int(m[1])}]", e.message, count=1)
        raise


def _named(error: GatewayError, field: str) -> GatewayError:
    """`error` naming the route's `field` where it names TEXT, and pointing at `chunking`."""
    error.message = _TEXT_INDEX.sub(lambda m: f"{field}[{m[1]}]", error.message, count=1)
    error.param = error.param or "chunking"
    return error


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


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first failure a task group collected (one chunk's, raised as a lone call's would be)."""
    error = group.exceptions[0]
    return _first_error(error) if isinstance(error, BaseExceptionGroup) else error


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


def _option_inputs(opts: EmbedRequest, shape: list[int]) -> list[Tensor]:
    """The optional embed inputs a request sets ([1] for the ensemble, [1, 1] for an encoder)."""
    inputs = []
    if opts.prompt_name is not None:
        inputs.append(Tensor("PROMPT_NAME", np.array([opts.prompt_name.encode()], dtype=object), "BYTES"))
    if opts.truncate is not None:
        inputs.append(Tensor("TRUNCATE_MODE", np.array([opts.truncate.encode()], dtype=object), "BYTES"))
    if opts.max_tokens is not None:
        inputs.append(Tensor("MAX_TOKENS", np.array([opts.max_tokens], dtype=np.int32), "INT32"))
    return inputs + _encoder_options(opts, shape)


def _encoder_options(opts: EmbedRequest, shape: list[int]) -> list[Tensor]:
    """The embed options that reach the encoder (the tokenizer applies the others)."""
    inputs = []
    if opts.dimensions is not None:
        inputs.append(Tensor("DIMENSIONS", np.array([opts.dimensions], dtype=np.int32).reshape(shape), "INT32"))
    if opts.normalize is not None:
        inputs.append(Tensor("NORMALIZE", np.array([opts.normalize], dtype=bool).reshape(shape), "BOOL"))
    if opts.encoding != "float32":  # (left out otherwise: the plain request of older servers)
        inputs.append(Tensor("ENCODING", np.array([opts.encoding.encode()], dtype=object).reshape(shape), "BYTES"))
    return inputs


class _Joined:
    """The answers of an ensemble's two steps made as two calls, read by the ensemble's output
    names (as_numpy), as the ensemble's one answer would be."""

    def __init__(self, answers: tuple[Any, Any], outputs: dict[str, tuple[int, str]]) -> None:
        self.answers, self.outputs = answers, outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        if name not in self.outputs:
            return None
        step, inner = self.outputs[name]
        return self.answers[step].as_numpy(inner)


class Backend:
    def __init__(self, pool: ReplicaPool, chunk_texts: int, chunk_chars: int, timeout_s: float,
                 api_key: str | None = None, tokenizers: LocalTokenizers | None = None,
                 admission: Admission | None = None, chunk_window: int = 2) -> None:
        self.pool = pool
        self.tokenizers = tokenizers or LocalTokenizers(None, 0)
        self.chunk_texts, self.chunk_chars, self.chunk_window = chunk_texts, chunk_chars, chunk_window
        self.timeout_s = timeout_s
        self.admission = admission or Admission(timeout_s)
        # Triton's inference is behind the first key when `pergola serve --api-key` started it
        self.http_headers = {API_KEY_HEADER: api_key} if api_key else None
        self.grpc_headers = {GRPC_API_KEY_HEADER: api_key} if api_key else None

    @contextlib.contextmanager
    def _admitted(self, model: ServedModel, chars: list[int] | None = None, tokens: int | None = None,
                  windows: tuple[int | None, int] | None = None) -> Iterator[Ticket]:
        """The request's ticket (admission.py) while it is answered, or its 429 / 413 before any
        of its work; a 429 from Triton later gets its Retry-After from the backlog too."""
        ticket = self.admission.admit(model, chars, tokens, windows)
        if ticket.left > CANCELLABLE_TOKENS:
            watch_client()  # (its client leaving cancels it: CancelOnDisconnect)
        try:
            yield ticket
        except GatewayError as e:
            refused_later(e, self.admission, model)
            raise
        finally:
            ticket.close()

    async def _encoded_here(self, texts: list[str], encode: Callable[[], E]) -> E:
        """The gateway's own tokenizing of `texts` (gateway/tokenizers.py: on the loop or a
        thread, by size); a refusal comes back as Triton's would."""
        try:
            return await self.tokenizers.run(sum(map(len, texts)), encode)
        except RequestError as e:
            raise _too_long(refused(str(e))) from None

    async def _infer(self, model: str, inputs: list[Tensor], outputs: list[str], version: str = "",
                     work: Ticket | None = None, cancellable: bool = False):
        """One Triton call on the least busy replica (another one if it is busy or gone); the answer
        reads as_numpy(name). Over the replica's HTTP port when known (gateway/triton_http.py: less
        of the gateway's CPU per call), over gRPC when `cancellable` (or no HTTP port): Triton passes
        a gRPC caller's cancellation on to the model, which the encoder sees between steps and drops
        the request; a closed HTTP connection it does not (perf/results/2026-12-06-a3538ba-cpu/NOTES.md).
        Triton is told the time the request has left (µs): the encoder drops work nobody waits for;
        and that the gateway admitted it (ADMITTED: the encoder does not refuse it for its queue)."""
        timeout_s = work.left_s() if work is not None else self.timeout_s
        if timeout_s <= 0:
            raise GatewayError(504, f"the request's time ran out (--request-timeout-s {self.timeout_s:g}) "
                                    "before all of it was answered")

        parameters = {ADMITTED: True} if work is not None else None  # (pergola.triton.adapter.ADMITTED)

        async def call(replica: Replica):
            if replica.http is not None and not cancellable:
                with triton_call(model, self.http_headers, "http") as headers:  # (gateway/tracing.py)
                    return await replica.http.infer(model, inputs, outputs, version, timeout_s, headers, parameters)
            with triton_call(model, self.grpc_headers, "grpc") as headers:
                return await replica.client.infer(
                    model, [_grpc_input(t) for t in inputs], model_version=version,
                    outputs=[InferRequestedOutput(name) for name in outputs], client_timeout=timeout_s,
                    timeout=int(timeout_s * 1e6), headers=headers, parameters=parameters)

        return await self.pool.call(call)

    async def _encode(self, model: ServedModel, inputs: list[Tensor], outputs: list[str], tokens: int,
                      work: Ticket, version: str = ""):
        """A call of `tokens` token ids to NAME_encoder: cancellable (gRPC) above CANCELLABLE_TOKENS."""
        return await self._infer(f"{model.target}_encoder", inputs, outputs, version, work,
                                 cancellable=tokens > CANCELLABLE_TOKENS)

    async def _through_tokenizer(self, model: ServedModel, inputs: list[Tensor], outputs: list[str], tokens: int,
                                 work: Ticket):
        """A chunk of texts (about `tokens` tokens) through the served ensemble's steps: one call to
        the ensemble when small; else NAME_tokenizer, then its ids to NAME_encoder over gRPC, so
        that a chunk given up on is not encoded (Triton does not cancel an ensemble's step in
        flight: catalog.Pipeline)."""
        steps = model.pipeline
        if tokens <= CANCELLABLE_TOKENS or steps is None:
            return await self._infer(model.name, inputs, outputs, work=work)
        wanted = {name: steps.outputs[name] for name in outputs if name in steps.outputs}
        first = await self._infer(f"{model.target}_tokenizer",
                                  [replace(t, name=steps.inputs[t.name]) for t in inputs if t.name in steps.inputs],
                                  [*steps.feeds, *(inner for step, inner in wanted.values() if step == 0)], work=work)
        feeds = [Tensor(steps.feeds[name], array, np_to_triton_dtype(array.dtype))
                 for name in steps.feeds if (array := first.as_numpy(name)) is not None]
        second = await self._infer(f"{model.target}_encoder", feeds,
                                   [inner for step, inner in wanted.values() if step == 1], work=work, cancellable=True)
        return _Joined((first, second), wanted)

    async def _chunked(self, calls: list[Callable[[], Awaitable[T]]]) -> list[T]:
        """The results of `calls` (a request's chunks), in order.

        At most chunk_window of them per replica are in flight, the next sent as one is answered:
        the encoder's admission (engine/loop.py) counts a request's queued chunks as work ahead of
        its next one, and with all 32 chunks of a 1,024-text request sent at once it refused the
        later ones, on an idle server too, and again at every retry. The first failure cancels
        the rest: chunks not yet sent are never sent, those in flight are cancelled (in Triton
        too, when over gRPC). One call is awaited as it is (a query's request is one chunk: no
        task to create and schedule; 96 -> 47 us of the gateway's CPU for a 128-id request,
        Triton's answer canned, on the 2-core CPU host)."""
        if len(calls) == 1:
            return [await calls[0]()]
        results: list[Any] = [None] * len(calls)
        todo = iter(enumerate(calls))

        async def sender() -> None:
            for i, call in todo:
                results[i] = await call()

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(len(calls), self.chunk_window * max(1, len(self.pool.replicas)))):
                    group.create_task(sender())
        except BaseExceptionGroup as e:
            raise _first_error(e) from None
        return results

    async def embed(self, model: ServedModel, texts: list[str], opts: EmbedRequest) -> Embedded:
        """Embeddings of `texts`: tokenized here when short (gateway/tokenizers.py), else through
        the embed ensemble's steps in chunks."""
        chars = lengths(texts)
        with self._admitted(model, chars) as work:
            return await self._here_or_ensemble(
                model, texts, lambda tok: self._embed_here(model, tok, texts, opts, work, chars),
                lambda: self._embed_ensemble(model, texts, opts, work, chars))

    async def embed_chunks(self, model: ServedModel, texts: list[str], opts: EmbedRequest, chunking: Chunking,
                           field: str = "input") -> ChunkedEmbedded:
        """`texts` cut into windows and embedded (pergola.text.chunking). Cut where they would be
        tokenized: here when the request is short and the gateway has the served version's files
        (TextTokenizer.chunk, on a tokenizing thread), else by NAME_tokenizer (CHUNK_SIZE) in chunks
        of texts spread over the replicas, as any long request's tokenizing is, off the gateway's
        CPU. The windows then go to NAME_encoder in chunks (late: each text's encoding windows
        together, with their CHUNK_SPANS), spread over the replicas like any chunk. They are the
        request's work from its admission on (Load.windowed), exactly once cut (Ticket.resize).
        Refusals name `field` (the route's) for the texts."""
        chars = lengths(texts)
        late = chunking.pooling == "late"

        async def here(tokenizer: TextTokenizer) -> ChunkedEmbedded:
            cut = await self._encoded_here(texts, lambda: tokenizer.chunk(
                texts, chunking.tokens, chunking.overlap, late, opts.prompt_name, model.chunk_limits()))
            return await self._encode_chunks(model, cut, tokenizer.spec.normalize, opts, chunking, work, chars,
                                             model.version or "")

        async def ensemble() -> ChunkedEmbedded:
            spans = chunks(chars, self.chunk_texts, self.chunk_chars)
            parts = await self._chunked([lambda a=a, b=b: _renumbered(a, self._cut_in_triton(model, texts[a:b], opts,
                                                                                             chunking, work))
                                         for a, b in spans])
            cut = Chunks.join([c for c, _ in parts])
            check_windows(cut.chunks.tolist(), model.chunk_limits())  # (each call checked its own texts)
            return await self._encode_chunks(model, cut, parts[0][1], opts, chunking, work, chars, "")

        with self._admitted(model, chars, windows=(None if late else chunking.tokens, chunking.overlap)) as work:
            try:
                return await self._here_or_ensemble(model, texts, here, ensemble)
            except RequestError as e:
                raise _named(refused(str(e)), field) from None
            except GatewayError as e:
                raise _named(e, field) from None

    async def _cut_in_triton(self, model: ServedModel, texts: list[str], opts: EmbedRequest, chunking: Chunking,
                             work: Ticket) -> tuple[Chunks, bool]:
        """`texts` cut by NAME_tokenizer (CHUNK_SIZE), and whether the model normalises by default."""
        inputs = [Tensor("TEXT", np.array([t.encode("utf-8") for t in texts], dtype=object), "BYTES"),
                  Tensor("CHUNK_SIZE", np.array([chunking.tokens or 0], dtype=np.int32), "INT32"),
                  Tensor("CHUNK_OVERLAP", np.array([chunking.overlap], dtype=np.int32), "INT32")]
        if chunking.pooling == "late":
            inputs.append(Tensor("CHUNK_LATE", np.array([True]), "BOOL"))
        if opts.prompt_name is not None:
            inputs.append(Tensor("PROMPT_NAME", np.array([opts.prompt_name.encode()], dtype=object), "BYTES"))
        r = await self._infer(f"{model.target}_tokenizer", inputs, _CHUNK_OUTPUTS, work=work)
        lengths_ = r.as_numpy("LENGTHS")[0]
        encoded = Encoded(r.as_numpy("INPUT_IDS")[0], lengths_, r.as_numpy("PROMPT_LENGTHS")[0],
                          np.zeros(lengths_.size, dtype=bool))
        cut = Chunks(encoded, r.as_numpy("CHUNK_SEQUENCES"), r.as_numpy("CHUNK_COUNTS"),
                     r.as_numpy("CHUNK_TEXT_SPANS")[0], r.as_numpy("CHUNK_LENGTHS"),
                     r.as_numpy("CHUNK_SPANS").reshape(-1, 3))
        return cut, bool(r.as_numpy("NORMALIZE_OUT").reshape(-1)[0])

    async def _encode_chunks(self, model: ServedModel, cut: Chunks, normalizes: bool, opts: EmbedRequest,
                             chunking: Chunking, work: Ticket, chars: list[int], version: str) -> ChunkedEmbedded:
        """The cut texts' sequences through NAME_encoder in chunks over the replicas -> their vectors:
        a row per window (each), per late chunk (late), or per text (mean: the token-weighted mean
        of its windows' vectors, normalised when `normalize` is on: the request's, else the model's
        `normalizes`)."""
        enc = cut.encoded
        work.resize(int(enc.lengths.sum()))
        mean = chunking.pooling == "mean"
        normalize = normalizes if opts.normalize is None else opts.normalize
        if mean:
            check_encoding(opts.encoding, normalize)  # (the encoder checks it for rows it encodes itself)
        asked = replace(opts, encoding="float32") if mean else opts
        output, dtype = OUTPUTS[asked.encoding]
        seq_at = np.zeros(enc.lengths.size + 1, dtype=np.int64)  # each sequence's first token
        np.cumsum(enc.lengths, out=seq_at[1:])
        text_seq = np.zeros(cut.sequences.size + 1, dtype=np.int64)  # each text's first sequence
        np.cumsum(cut.sequences, out=text_seq[1:])
        text_chunk = np.zeros(cut.chunks.size + 1, dtype=np.int64)  # each text's first chunk
        np.cumsum(cut.chunks, out=text_chunk[1:])

        async def one(a: int, b: int, spans: np.ndarray | None = None) -> np.ndarray:
            """Sequences [a, b) (with their late chunks' CHUNK_SPANS) -> their rows."""
            t0, t1 = int(seq_at[a]), int(seq_at[b])
            inputs = [Tensor("INPUT_IDS", enc.input_ids[None, t0:t1], "INT64"),
                      Tensor("LENGTHS", enc.lengths[None, a:b], "INT32")]
            if enc.prompt_lengths[a:b].any():
                inputs.append(Tensor("PROMPT_LENGTHS", enc.prompt_lengths[None, a:b], "INT32"))
            if spans is not None:
                inputs.append(Tensor("CHUNK_SPANS", spans.reshape(1, -1), "INT64"))
            result = await self._encode(model, [*inputs, *_encoder_options(asked, [1, 1])], [output], t1 - t0, work,
                                        version)
            work.answered(None, enc.lengths[a:b])
            return result.as_numpy(output).view(dtype)

        def late_call(a: int, b: int) -> Awaitable[np.ndarray]:
            """Texts [a, b): their encoding windows and chunks' CHUNK_SPANS, renumbered for the call."""
            k0, k1 = int(text_chunk[a]), int(text_chunk[b])
            rows = cut.ranges[np.searchsorted(cut.ranges[:, 0], k0):np.searchsorted(cut.ranges[:, 0], k1)]
            t0 = int(seq_at[text_seq[a]])
            return one(int(text_seq[a]), int(text_seq[b]), rows - np.array([k0, t0, t0], dtype=np.int64))

        if chunking.pooling == "late":
            calls = [partial(late_call, a, b) for a, b in chunks(chars, self.chunk_texts, self.chunk_chars)]
        else:
            calls = [partial(one, a, b) for a, b in chunks((cut.spans[:, 1] - cut.spans[:, 0]).tolist(),
                                                           self.chunk_texts, self.chunk_chars)]
        vectors = np.concatenate(await self._chunked(calls))
        if mean:
            vectors = quantize(weighted_means(vectors, cut.tokens, text_chunk[:-1], normalize), opts.encoding)
        return ChunkedEmbedded(vectors, cut.chunks, cut.spans, np.add.reduceat(enc.lengths, text_seq[:-1]))

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
                              opts: EmbedRequest) -> tuple[list[Tensor], np.ndarray]:
        """`texts` tokenized as NAME_tokenizer would -> NAME_encoder's inputs and each text's tokens."""
        enc = await self._encoded_here(texts, lambda: tokenizer.encode(
            texts, prompt_name=opts.prompt_name, max_tokens=opts.max_tokens, truncate=_truncate(model, opts.truncate)))
        inputs = _id_inputs(enc)
        if enc.prompt_lengths.any():
            inputs.append(Tensor("PROMPT_LENGTHS", enc.prompt_lengths[None, :], "INT32"))
        return inputs + _encoder_options(opts, [1, 1]), enc.lengths

    async def _embed_here(self, model: ServedModel, tokenizer: TextTokenizer, texts: list[str],
                          opts: EmbedRequest, work: Ticket, chars: list[int]) -> Embedded:
        """`texts` tokenized here, their ids to the same version of NAME_encoder."""
        output, dtype = OUTPUTS[opts.encoding]
        inputs, tokens = await self._tokenized_here(model, tokenizer, texts, opts)
        result = await self._encode(model, inputs, [output], int(tokens.sum()), work, model.version or "")
        work.answered(chars, tokens)
        return Embedded(result.as_numpy(output).view(dtype), tokens)

    async def _embed_ensemble(self, model: ServedModel, texts: list[str], opts: EmbedRequest, work: Ticket,
                              chars: list[int]) -> Embedded:
        output, dtype = OUTPUTS[opts.encoding]

        async def one(start: int, end: int) -> Embedded:
            data = np.array([t.encode("utf-8") for t in texts[start:end]], dtype=object)
            inputs = [Tensor("TEXT", data, "BYTES"), *_option_inputs(opts, [1])]
            result = await self._through_tokenizer(model, inputs, [output, "TOKEN_COUNT"],
                                                   work.estimate(chars[start:end]), work)
            part = Embedded(result.as_numpy(output).view(dtype), result.as_numpy("TOKEN_COUNT"))
            work.answered(chars[start:end], part.tokens)
            return part

        spans = chunks(chars, self.chunk_texts, self.chunk_chars)
        parts = await self._chunked([lambda a=a, b=b: _numbered(a, one(a, b)) for a, b in spans])
        return Embedded(np.concatenate([p.vectors for p in parts]), np.concatenate([p.tokens for p in parts]))

    async def per_token(self, model: ServedModel, texts: list[str], outputs: list[str],
                        opts: EmbedRequest = EmbedRequest()) -> PerToken:
        """bge-m3's `outputs` (sparse, colbert) of `texts`: tokenized here when short, else from
        the embed ensemble's OUTPUTS in chunks."""
        asked = np.array([o.encode() for o in outputs], dtype=object)
        chars = lengths(texts)

        async def here(tokenizer: TextTokenizer) -> PerToken:
            inputs, tokens = await self._tokenized_here(model, tokenizer, texts, opts)
            r = await self._encode(model, [*inputs, Tensor("OUTPUTS", asked[None, :], "BYTES")], _PER_TOKEN[:-1],
                                   int(tokens.sum()), work, model.version or "")
            work.answered(chars, tokens)
            return _per_token_answer(r, tokens)

        async def one(start: int, end: int) -> PerToken:
            data = np.array([t.encode("utf-8") for t in texts[start:end]], dtype=object)
            inputs = [Tensor("TEXT", data, "BYTES"), Tensor("OUTPUTS", asked, "BYTES"), *_option_inputs(opts, [1])]
            r = await self._through_tokenizer(model, inputs, _PER_TOKEN, work.estimate(chars[start:end]), work)
            work.answered(chars[start:end], r.as_numpy("TOKEN_COUNT"))
            return _per_token_answer(r, r.as_numpy("TOKEN_COUNT"))

        async def ensemble() -> PerToken:
            spans = chunks(chars, self.chunk_texts, self.chunk_chars)
            parts = await self._chunked([lambda a=a, b=b: _numbered(a, one(a, b)) for a, b in spans])
            return PerToken([s for p in parts for s in p.sparse], [c for p in parts for c in p.colbert],
                            np.concatenate([p.tokens for p in parts]))

        with self._admitted(model, chars) as work:
            return await self._here_or_ensemble(model, texts, here, ensemble)

    async def embed_tokens(self, model: ServedModel, ids: TokenIds, opts: EmbedRequest) -> Embedded:
        """Pre-tokenized input, straight to NAME_encoder (no prompt, no truncation there)."""
        output, dtype = OUTPUTS[opts.encoding]
        offsets = ids.offsets()

        async def one(start: int, end: int) -> np.ndarray:
            lengths = ids.lengths[None, start:end]
            inputs = [Tensor("INPUT_IDS", ids.flat[None, offsets[start]:offsets[end]], "INT64"),
                      Tensor("LENGTHS", lengths, "INT32"), *_option_inputs(opts, [1, 1])]
            result = await self._encode(model, inputs, [output], int(offsets[end] - offsets[start]), work)
            work.answered(None, lengths)
            return result.as_numpy(output).view(dtype)

        with self._admitted(model, tokens=int(ids.flat.size)) as work:
            spans = chunks(ids.lengths.tolist(), self.chunk_texts, self.chunk_chars)
            parts = await self._chunked([lambda a=a, b=b: one(a, b) for a, b in spans])
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

        spans = chunks([len(t) for t in texts], self.chunk_texts, self.chunk_chars)
        parts = await self._chunked([lambda a=a, b=b: one(a, b) for a, b in spans])
        return Tokenized(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("ids", "lengths", "pieces",
                                                                                     "offsets")))

    async def rerank(self, model: ServedModel, query: str, documents: list[str],
                     opts: RerankRequest = RerankRequest()) -> Reranked:
        """Scores [n] float32 of `documents` against `query` and each pair's tokens, in input order:
        tokenized here when the request is short (gateway/tokenizers.py), else through the
        rerank ensemble's steps in chunks."""
        chars = [len(query) + len(d) for d in documents]  # each (query, document) pair's
        with self._admitted(model, chars) as work:
            return await self._here_or_ensemble(
                model, [query, *documents],
                lambda tok: self._rerank_here(model, tok, query, documents, opts, work, chars),
                lambda: self._rerank_ensemble(model, query, documents, opts, work, chars))

    async def _rerank_here(self, model: ServedModel, tokenizer: RerankTokenizer, query: str, documents: list[str],
                           opts: RerankRequest, work: Ticket, chars: list[int]) -> Reranked:
        """The pairs tokenized as NAME_tokenizer would, their ids to the same version of NAME_encoder."""
        enc = await self._encoded_here([query, *documents], lambda: tokenizer.encode(
            query, documents, max_document_tokens=opts.max_document_tokens, instruction=opts.instruction,
            truncate=_truncate(model, opts.truncate)))
        inputs = _id_inputs(enc, token_types=True, raw_scores=opts.raw_scores)
        result = await self._encode(model, inputs, ["SCORE"], int(enc.lengths.sum()), work, model.version or "")
        work.answered(chars, enc.lengths)
        return Reranked(result.as_numpy("SCORE"), enc.lengths)

    async def _rerank_ensemble(self, model: ServedModel, query: str, documents: list[str],
                               opts: RerankRequest, work: Ticket, chars: list[int]) -> Reranked:
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
            result = await self._through_tokenizer(model, [*options, Tensor("DOCUMENTS", docs, "BYTES")],
                                                   ["SCORE", "TOKEN_COUNT"], work.estimate(chars[start:end]), work)
            part = Reranked(result.as_numpy("SCORE"), result.as_numpy("TOKEN_COUNT"))
            work.answered(chars[start:end], part.tokens)
            return part

        spans = chunks(chars, self.chunk_texts, self.chunk_chars)
        parts = await self._chunked([lambda a=a, b=b: _numbered(a, one(a, b)) for a, b in spans])
        return Reranked(np.concatenate([p.scores for p in parts]), np.concatenate([p.tokens for p in parts]))

    async def classify(self, model: ServedModel, texts: list[str], pairs: list[str | None] | None = None,
                       opts: ClassifyRequest = ClassifyRequest()) -> Classified:
        """Class probabilities [n, labels] of `texts` (pairs[i]: text i's second sequence, None for
        none), in input order: tokenized here when the request is short (gateway/tokenizers.py),
        else through the classify ensemble's steps in chunks. Single texts and pairs go in separate
        calls (TEXT_PAIR pairs all of a call's texts)."""
        pairs = pairs or [None] * len(texts)
        groups = [[i for i, p in enumerate(pairs) if p is None], [i for i, p in enumerate(pairs) if p is not None]]
        chars = [len(t) + len(p or "") for t, p in zip(texts, pairs)]  # each input's, its pair's included
        options = [Tensor("RAW_SCORES", np.array([True]), "BOOL")] if opts.raw_scores else []
        if opts.truncate is not None:
            options.append(Tensor("TRUNCATE_MODE", np.array([opts.truncate.encode()], dtype=object), "BYTES"))

        async def one(index: list[int], paired: bool) -> Classified:
            inputs = [*options, Tensor("TEXT", np.array([texts[i].encode("utf-8") for i in index], dtype=object),
                                        "BYTES")]
            if paired:
                inputs.append(Tensor("TEXT_PAIR", np.array([pairs[i].encode("utf-8") for i in index],  # type: ignore[union-attr]
                                                             dtype=object), "BYTES"))
            result = await self._through_tokenizer(model, inputs, ["PROBS", "LABELS", "TOKEN_COUNT"],
                                                   work.estimate([chars[i] for i in index]), work)
            work.answered([chars[i] for i in index], result.as_numpy("TOKEN_COUNT"))
            return _classified(result, result.as_numpy("TOKEN_COUNT"))

        def one_here(tokenizer: ClassifyTokenizer) -> Callable[[list[int], bool], Awaitable[Classified]]:
            async def call(index: list[int], paired: bool) -> Classified:
                chosen = [texts[i] for i in index]
                second = [pairs[i] for i in index] if paired else None
                enc = await self._encoded_here([*chosen, *(second or [])], lambda: tokenizer.encode(
                    chosen, second, truncate=_truncate(model, opts.truncate)))
                inputs = _id_inputs(enc, token_types=True, raw_scores=opts.raw_scores)
                result = await self._encode(model, inputs, ["PROBS", "LABELS"], int(enc.lengths.sum()), work,
                                            model.version or "")
                work.answered([chars[i] for i in index], enc.lengths)
                return _classified(result, enc.lengths)
            return call

        async def numbered(call, index: list[int], paired: bool) -> tuple[list[int], Classified]:
            try:
                return index, await _numbered(0, call(index, paired))
            except TooLong as e:  # name the request's input, not the call's
                raise TooLong(index[e.index], e.limit, e.message) from None

        async def assembled(calls: list[Callable[[], Awaitable[tuple[list[int], Classified]]]]) -> Classified:
            parts = await self._chunked(calls)
            labels = parts[0][1].labels
            probs = np.empty((len(texts), len(labels)), dtype=np.float32)
            tokens = np.empty(len(texts), dtype=np.int64)
            for index, part in parts:
                probs[index], tokens[index] = part.probs, part.tokens
            return Classified(probs, labels, tokens)

        with self._admitted(model, chars) as work:
            return await self._here_or_ensemble(
                model, [*texts, *(p for p in pairs if p is not None)],
                lambda tok: assembled([partial(numbered, one_here(tok), group, bool(paired))
                                       for paired, group in enumerate(groups) if group]),
                lambda: assembled([partial(numbered, one, group[a:b], bool(paired))
                                   for paired, group in enumerate(groups)
                                   for a, b in chunks([chars[i] for i in group],
                                                      self.chunk_texts, self.chunk_chars)]))
