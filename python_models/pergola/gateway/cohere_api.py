"""Cohere's embed API: `POST /v2/embed` and `POST /v1/embed` (the cohere SDK's ClientV2.embed
and Client.embed).

    {"model": "embed", "texts": ["..."], "input_type": "search_query", "embedding_types":
     ["float", "int8", "uint8", "binary", "ubinary", "base64"], "truncate": "END",
     "max_tokens": 128, "output_dimension": 256}
 -> {"id", "response_type": "embeddings_by_type", "embeddings": {"float": [[...]], "int8": ...},
     "texts", "meta": {"api_version", "billed_units": {"input_tokens"}}}

v1 without `embedding_types` answers {"response_type": "embeddings_floats", "embeddings":
[[...]], ...}, as Cohere does. `input_type` search_query takes the model's query prompt,
search_document its document prompt (where the model has them: Cohere's SDK always sends one);
classification and clustering none. The types come from one
float32 call, quantized here as the encoder does (pergola.text.encodings): int8 is round(127 x) of the
unit vector, uint8 int8 + 128, ubinary the sign bits (8 dimensions a byte, first in the high bit),
binary ubinary - 128, base64 the float32 bytes (little-endian) of each row. Images, `inputs`
with image parts and a priority other than 0 are refused with 400 naming the field.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from pergola.gateway.backend import EmbedRequest, TooLong
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import bad_request
from pergola.gateway.http import Body, answer
from pergola.gateway.openai_api import too_long, truncate_option
from pergola.gateway.state import Gateway
from pergola.gateway.vllm_api import check_max_tokens
from pergola.text.encodings import INT8_SCALE, quantize
from pergola.text.errors import quote, read_strings

INPUT_TYPES = {"search_query": "query", "search_document": "document", "classification": None, "clustering": None}
EMBEDDING_TYPES = ("float", "int8", "uint8", "binary", "ubinary", "base64")
UNIT_TOLERANCE = 1e-3  # int8 codes need unit rows (encodings.check_encoding): |norm - 1| at most this


def _texts(body: Body) -> list[str]:
    """`texts`, or `inputs` whose content is text only (Cohere's mixed form); images are refused."""
    if body.data.get("images"):
        raise bad_request("`images` are not supported: pergola serves text models; send `texts`", "images")
    if body.data.get("inputs") is not None and body.data.get("texts") is not None:
        raise bad_request("send `texts` or `inputs`, not both", "inputs")
    if body.data.get("inputs") is None:
        texts = body.get("texts", list, required=True)
    else:
        texts = [_text_of(item) for item in body.get("inputs", list)]
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("`texts` must be a list of strings", "texts")
    return texts


def _text_of(item: Any) -> str:
    """An `inputs` item's text: {"content": [{"type": "text", "text": "..."}, ...]}, its parts joined."""
    parts = item.get("content") if isinstance(item, dict) else None
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "text"
                                              and isinstance(p.get("text"), str) for p in parts):
        raise bad_request("`inputs` items must hold text parts only ({\"type\": \"text\", \"text\": ...}): "
                          "pergola serves text models", "inputs")
    return " ".join(p["text"] for p in parts)


def _types(body: Body, default: list[str] | None) -> list[str] | None:
    types = body.get("embedding_types", list, default)
    if types is not None:
        bad = [t for t in types if t not in EMBEDDING_TYPES]
        if bad or not types:
            raise bad_request(f"`embedding_types` must be some of {', '.join(EMBEDDING_TYPES)}, "
                              f"got {quote(bad[0] if bad else types)}", "embedding_types")
    return types


def _options(body: Body, model: ServedModel) -> EmbedRequest:
    input_type = body.get("input_type", str)
    if input_type is not None and input_type not in INPUT_TYPES:
        why = "pergola serves text models" if input_type == "image" else f"use one of {', '.join(INPUT_TYPES)}"
        raise bad_request(f"`input_type` {quote(input_type)} is not supported: {why}", "input_type")
    priority = body.data.get("priority")
    if priority is not None and (type(priority) is not int or priority != 0):
        raise bad_request(f"`priority`={quote(priority)} is not supported: requests are served first come first "
                          "served (queries in a lane of their own)", "priority")
    prompt = INPUT_TYPES.get(input_type) if input_type else None
    if model.prompts is not None and prompt not in model.prompts:  # (a model without that prompt: none)
        prompt = None
    return EmbedRequest(prompt_name=prompt,
                        dimensions=body.count("output_dimension"), truncate=truncate_option(body) or "END",
                        max_tokens=body.count("max_tokens"))


def by_type(floats: np.ndarray, types: list[str]) -> dict[str, Any]:
    """Each asked type's rows from the float32 rows [n, d] (module docstring)."""
    out: dict[str, Any] = {}
    if any(t in ("int8", "uint8") for t in types):
        norms = np.linalg.norm(floats, axis=1)
        if len(norms) and np.abs(norms - 1).max() > UNIT_TOLERANCE:
            raise bad_request(f"int8 and uint8 scale by a fixed {INT8_SCALE:g} and need unit-length vectors; this "
                              "model's are not normalised: ask for float, binary or ubinary", "embedding_types")
    for kind in types:
        if kind == "float":
            out["float"] = floats
        elif kind == "base64":
            out["base64"] = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in floats]
        elif kind in ("int8", "uint8"):
            codes = quantize(floats, "int8")
            out[kind] = codes if kind == "int8" else (codes.astype(np.int16) + 128).astype(np.uint8)
        else:
            codes = quantize(floats, "binary")
            out[kind] = codes if kind == "ubinary" else (codes.astype(np.int16) - 128).astype(np.int8)
    return out


def embed_answer(embeddings: Any, texts: list[str], tokens: int, version: str, response_type: str) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "response_type": response_type, "embeddings": embeddings, "texts": texts,
            "meta": {"api_version": {"version": version}, "billed_units": {"input_tokens": tokens}}}


async def _embed(gw: Gateway, request: Request, version: str) -> Response:
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), "embed")
    opts = _options(body, model)
    check_max_tokens(opts, model)
    types = _types(body, ["float"] if version == "2" else None)
    texts = read_strings(_texts(body), "texts", "text", model.text_limits())
    try:
        out = await gw.backend.embed(model, texts, opts)
    except TooLong as e:
        raise too_long(e, "texts", 'send "truncate": "END" (or "START") to cut it') from None
    tokens = int(out.tokens.sum())
    if types is None:  # v1's plain form
        return await answer(gw.offload, out.vectors.size, embed_answer, out.vectors, texts, tokens, version,
                            "embeddings_floats")
    return await answer(gw.offload, out.vectors.size * len(types), embed_answer, by_type(out.vectors, types), texts,
                        tokens, version, "embeddings_by_type")


async def embed_v2(gw: Gateway, request: Request) -> Response:
    return await _embed(gw, request, "2")


async def embed_v1(gw: Gateway, request: Request) -> Response:
    return await _embed(gw, request, "1")
