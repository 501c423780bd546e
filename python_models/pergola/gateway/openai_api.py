"""OpenAI's embeddings API: `POST /v1/embeddings`, `GET /v1/models`; and vLLM's `POST /pooling` for
the embed task, which takes the same request and answers in vLLM's pooling form.

`input` is a string, a list of strings, a list of token ids or a list of such lists (token ids
go straight to NAME_encoder). Besides OpenAI's fields (`model`, `dimensions`, `encoding_format`
float|base64, `user` ignored), pergola takes `prompt_name` or `input_type` (query, passage or
document; Cohere's search_query / search_document too), `truncate` (NONE, START or END as NIM and
Cohere send it, or true = END / false = NONE), `max_tokens` (Cohere's: a limit below the model's),
`normalize` (TEI's; default the model's), `chunking` (long texts in windows: gateway/chunking.py),
vLLM's pooling fields (vllm_api.py: `truncate_prompt_tokens`, `truncation_side`, `use_activation`,
`embed_dtype`, `endianness`), and `embedding_type` with
Cohere's meanings: float, float16, int8 (round(127 x) of the unit vector), uint8 (int8 + 128),
ubinary (sign bits, 8 dimensions a byte, first in the high bit) and binary (ubinary - 128, as
int8). base64 carries the little-endian bytes of each row in that type.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from pergola.gateway.backend import Embedded, EmbedRequest, TooLong
from pergola.gateway.chunking import chunking_option, openai_chunked
from pergola.gateway.errors import GatewayError, bad_request
from pergola.gateway.http import Body, answer
from pergola.gateway.offload import TokenIds
from pergola.gateway.state import Gateway
from pergola.gateway.vllm_api import Pooling
from pergola.text.errors import RequestError, quote, read_strings
from pergola.text.tokenization import truncate_mode

_SAME = lambda codes: codes  # noqa: E731
# embedding_type -> (Triton ENCODING, codes -> the values sent)
EMBEDDING_TYPES: dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]] = {
    "float": ("float32", _SAME),
    "float16": ("float16", _SAME),
    "int8": ("int8", _SAME),
    "uint8": ("int8", lambda codes: (codes.astype(np.int16) + 128).astype(np.uint8)),
    "ubinary": ("binary", _SAME),
    "binary": ("binary", lambda codes: (codes.astype(np.int16) - 128).astype(np.int8)),
}
INPUT_TYPES = {"query": "query", "search_query": "query",
               "passage": "document", "document": "document", "search_document": "document"}


def truncate_option(body: Body, name: str = "truncate") -> str | None:
    """`truncate` as NIM and Cohere send it (NONE, START, END; any case) or as a boolean (true = END)."""
    value = body.get(name, (str, bool))
    if value is None:
        return None
    try:
        return truncate_mode(value, name=f"`{name}`")
    except RequestError as e:
        raise GatewayError(422, str(e), name) from None


def too_long(e: TooLong, field: str, hint: str) -> GatewayError:
    """A text over the token limit with truncation off, named by the API's field."""
    return GatewayError(400, f"{field}[{e.index}] has more than {e.limit} tokens, the most this request allows "
                             f"(the model's limit, or the one it asked for); shorten it or {hint}", field)


def embed_request(body: Body, embedding_type: str) -> EmbedRequest:
    prompt = body.get("prompt_name", str)
    input_type = body.get("input_type", str)
    if input_type is not None:
        if input_type not in INPUT_TYPES:
            raise GatewayError(422, f"`input_type` must be one of {', '.join(INPUT_TYPES)}, got {quote(input_type)}",
                               "input_type")
        if prompt is not None and prompt != INPUT_TYPES[input_type]:
            raise GatewayError(422, "send `prompt_name` or `input_type`, not both", "input_type")
        prompt = INPUT_TYPES[input_type]
    return EmbedRequest(prompt_name=prompt, dimensions=body.count("dimensions"), truncate=truncate_option(body),
                        max_tokens=body.count("max_tokens"), normalize=body.get("normalize", bool),
                        encoding=EMBEDDING_TYPES[embedding_type][0])


def wire_rows(values: np.ndarray, as_base64: bool) -> np.ndarray | list[str]:
    """`values` [n, dim]: a row per input, base64 of its bytes or the numbers themselves."""
    return [base64.b64encode(row.tobytes()).decode() for row in values] if as_base64 else values


def embeddings_answer(name: str, values: np.ndarray, as_base64: bool, tokens: int) -> dict[str, Any]:
    """The answer's JSON content: `values` [n, dim] a row per input (base64 of its bytes, or the numbers)."""
    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i, "embedding": row}
                     for i, row in enumerate(wire_rows(values, as_base64))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def pooling_answer(name: str, values: np.ndarray, as_base64: bool, tokens: int) -> dict[str, Any]:
    """vLLM's /pooling answer: each input's row under `data[i].data`."""
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
            "data": [{"index": i, "object": "pooling", "data": row} for i, row in enumerate(wire_rows(values, as_base64))],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def pooling(gw: Gateway, request: Request) -> Response:
    """vLLM's `POST /pooling` with `task` "embed" (its default for an embedding model): the fields of
    /v1/embeddings, vLLM's answer. Its other tasks have routes of their own here: /classify, /embed_all."""
    body = await gw.body(request, ids_field="input")
    task = body.get("task", str, "embed")
    if task != "embed":
        raise bad_request(f"/pooling serves `task` \"embed\" here, got {quote(task)}: /classify classifies, "
                          "/embed_all gives bge-m3's per-token vectors", "task")
    if body.data.get("chunking") is not None:
        raise bad_request("`chunking` is a field of /v1/embeddings", "chunking")
    return await embeddings(gw, request, pooling_answer)


async def embeddings(gw: Gateway, request: Request,
                     shape: Callable[[str, np.ndarray, bool, int], dict[str, Any]] = embeddings_answer) -> Response:
    """`shape`: the answer's JSON (OpenAI's, or vLLM's pooling form)."""
    body = await gw.body(request, ids_field="input")
    model = await gw.model(body.get("model", str), "embed")
    pooling = Pooling.of(body, model)  # vLLM's fields (vllm_api.py)
    raw = body.get("input", (str, list, TokenIds), required=True)
    embedding_type = body.get("embedding_type", str, "float")
    if embedding_type not in EMBEDDING_TYPES:
        raise GatewayError(422, f"`embedding_type` must be one of {', '.join(EMBEDDING_TYPES)}, "
                                f"got {quote(embedding_type)}", "embedding_type")
    encoding_format = body.get("encoding_format", str, "float")
    if encoding_format not in ("float", "base64"):
        raise GatewayError(422, f"`encoding_format` must be float or base64, got {quote(encoding_format)}",
                           "encoding_format")
    opts = embed_request(body, embedding_type)
    opts = pooling.options(opts, model, token_ids=isinstance(raw, TokenIds))
    chunking = chunking_option(body)
    if chunking is not None:  # long texts in windows (gateway/chunking.py)
        if pooling.keep is not None or not pooling.native_floats:
            raise bad_request("`chunking` answers float32 windows of whole texts: send it without "
                              "`truncate_prompt_tokens`, `embed_dtype` and `endianness`", "chunking")
        return await openai_chunked(gw, model, raw, opts, chunking, EMBEDDING_TYPES[embedding_type][1],
                                    encoding_format == "base64")
    if isinstance(raw, TokenIds):  # (gw.body reads token ids so: checked, flat)
        raw = pooling.cut(raw)
        if opts.prompt_name is not None or opts.truncate is not None or opts.max_tokens is not None:
            raise GatewayError(422, "token-id input is sent as it is: no prompt_name, input_type, truncate or "
                                    "max_tokens")
        limits = model.text_limits()
        if len(raw.lengths) > limits.max_count:
            raise GatewayError(413, f"{len(raw.lengths):,} inputs in one request; the limit is {limits.max_count:,} "
                                    "(max_texts): split them over several requests")
        out: Embedded = await gw.backend.embed_tokens(model, raw, opts)
    else:
        texts = [raw] if isinstance(raw, str) else raw
        if not all(isinstance(t, str) for t in texts):
            raise GatewayError(422, "`input` must be a string, a list of strings, or token ids", "input")
        try:
            out = await gw.backend.embed(model, read_strings(texts, "input", "text", model.text_limits()), opts)
        except TooLong as e:
            raise too_long(e, "input", 'send "truncate": "END" (or "START") to cut it') from None
    values = EMBEDDING_TYPES[embedding_type][1](out.vectors)
    if encoding_format == "base64":
        values = pooling.wire(values)
    return await answer(gw.offload, values.size, shape, model.name, values, encoding_format == "base64",
                        int(out.tokens.sum()))


async def models(gw: Gateway, request: Request) -> dict[str, Any]:
    catalog = await gw.catalog()
    return {"object": "list", "data": [{"id": name, "object": "model", "created": gw.started, "owned_by": "pergola",
                                        "task": m.task} for name, m in catalog.items()]}
