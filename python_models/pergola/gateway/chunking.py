"""`chunking` on `POST /v1/embeddings` and TEI's `POST /embed`: long texts embedded in windows, in
one request (docs/long-documents.md; the windows: pergola.text.chunking).

    "chunking": {"tokens": 256, "overlap": 32, "pooling": "each" | "mean" | "late"}

OpenAI's answer holds, per input in order:
    each, late  a data item per window: {"object": "embedding", "index": <input>, "chunk": <0-based>,
                "text_span": [start_char, end_char), "embedding": ...}
    mean        one item per input: {"object": "embedding", "index", "chunks": <windows>, "embedding"}
usage.prompt_tokens counts every token encoded (each window's, special tokens and prompt included).
TEI's answer is the same items without "object" (each, late), or one vector per input (mean), as
its /embed answers; the tokens encoded come in `x-total-tokens`.

Everything is checked before any work: the object's fields (400 naming `chunking.FIELD`),
combinations that cannot hold (token ids: nothing to cut; `truncate` to a side or `max_tokens`:
nothing is cut with chunking; 400 naming them), the texts' characters (read_strings); the windows'
size against the model's limit and their count against max_text_chunks / max_request_chunks once
the texts are tokenized, before anything is encoded.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.responses import Response

from pergola.gateway.backend import ChunkedEmbedded, Chunking, EmbedRequest
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import bad_request
from pergola.gateway.http import Body, answer
from pergola.gateway.offload import INT32_MAX, TokenIds, as_is
from pergola.gateway.state import Gateway
from pergola.text.errors import quote, read_strings

POOLINGS = ("each", "mean", "late")
FIELDS = ("tokens", "overlap", "pooling")


def chunking_option(body: Body) -> Chunking | None:
    """The body's `chunking` object, checked (400 naming `chunking.FIELD`); None when not sent."""
    raw = body.get("chunking", dict)
    if raw is None:
        return None
    unknown = [k for k in raw if k not in FIELDS]
    if unknown:
        raise bad_request(f"`chunking` takes {', '.join(FIELDS)}; {quote(unknown[0])} is not one of them",
                          f"chunking.{unknown[0]}")
    tokens = _integer(raw, "tokens", 1)
    overlap = _integer(raw, "overlap", 0) or 0
    if tokens is not None and overlap >= tokens:
        raise bad_request(f"`chunking.overlap` ({overlap}) must be below `chunking.tokens` ({tokens}): windows "
                          "must move on", "chunking.overlap")
    pooling = raw.get("pooling", "each")
    if pooling not in POOLINGS:
        raise bad_request(f"`chunking.pooling` must be one of {', '.join(POOLINGS)}, got {quote(pooling)}",
                          "chunking.pooling")
    return Chunking(tokens, overlap, pooling)


def _integer(raw: dict[str, Any], name: str, least: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if type(value) is not int or not least <= value <= INT32_MAX:
        shown = "true or false" if isinstance(value, bool) else quote(value)
        raise bad_request(f"`chunking.{name}` must be an integer from {least} to {INT32_MAX:,}, got {shown}",
                          f"chunking.{name}")
    return value


def _refuse_cutting(truncate: str | bool | None, max_tokens: int | None) -> None:
    """With chunking nothing is cut: `truncate` to a side, or `max_tokens`, contradicts it."""
    if truncate in ("START", "END", True):
        raise bad_request("`truncate` cuts a text to the model's limit, `chunking` cuts it into windows that fit: "
                          "send one of them", "truncate")
    if max_tokens is not None:
        raise bad_request("`max_tokens` does not apply with `chunking`: set the window's size with "
                          "`chunking.tokens`", "max_tokens")


async def openai_chunked(gw: Gateway, model: ServedModel, raw: object, opts: EmbedRequest, chunking: Chunking,
                         convert: Callable[[np.ndarray], np.ndarray], as_base64: bool) -> Response:
    """OpenAI's /v1/embeddings with `chunking`; `convert`: the embedding_type's codes -> values sent."""
    if isinstance(raw, TokenIds):
        raise bad_request("`chunking` cuts texts on their tokens' characters: send `input` as text", "chunking")
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise bad_request("`input` must be a string or a list of strings with `chunking`", "input")
    _refuse_cutting(opts.truncate, opts.max_tokens)
    texts = read_strings(texts, "input", "text", model.text_limits())
    out = await gw.backend.embed_chunks(model, texts, opts, chunking, "input")
    values = convert(out.vectors)
    return await answer(gw.offload, values.size, openai_answer, model.name, values, as_base64, out,
                        chunking.pooling == "mean")


async def tei_chunked(gw: Gateway, body: Body, model: ServedModel, texts: list[str], opts: EmbedRequest,
                      chunking: Chunking) -> Response:
    """TEI's /embed with `chunking` (texts already read); `truncate: true` contradicts it."""
    _refuse_cutting(body.get("truncate", bool), None)
    out = await gw.backend.embed_chunks(model, texts, EmbedRequest(prompt_name=opts.prompt_name,
                                                                   dimensions=opts.dimensions,
                                                                   normalize=opts.normalize), chunking, "inputs")
    headers = {"x-total-tokens": str(int(out.tokens.sum()))}
    if chunking.pooling == "mean":
        return await answer(gw.offload, out.vectors.size, as_is, out.vectors, headers=headers)
    return await answer(gw.offload, out.vectors.size, chunk_items, out.vectors, out, headers=headers)


def chunk_items(rows: Any, out: ChunkedEmbedded, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A data item per chunk, in order: {**extra, "index": input, "chunk", "text_span", "embedding"}."""
    index = np.repeat(np.arange(out.chunks.size), out.chunks).tolist()
    firsts = np.repeat(np.cumsum(out.chunks) - out.chunks, out.chunks)
    chunk = (np.arange(int(out.chunks.sum())) - firsts).tolist()
    return [{**(extra or {}), "index": i, "chunk": c, "text_span": span, "embedding": row}
            for i, c, span, row in zip(index, chunk, out.spans.tolist(), rows)]


def openai_answer(name: str, values: np.ndarray, as_base64: bool, out: ChunkedEmbedded, mean: bool
                  ) -> dict[str, Any]:
    """OpenAI's answer (module docstring): `values` a row per chunk, or per input when `mean`."""
    rows = [base64.b64encode(row.tobytes()).decode() for row in values] if as_base64 else values
    if mean:
        data = [{"object": "embedding", "index": i, "chunks": k, "embedding": row}
                for i, (k, row) in enumerate(zip(out.chunks.tolist(), rows))]
    else:
        data = chunk_items(rows, out, {"object": "embedding"})
    tokens = int(out.tokens.sum())
    return {"object": "list", "model": name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
