"""Reranking in Cohere's and Jina's form: `POST /v1/rerank`, `/v2/rerank`, and `/rerank` when
the body has `documents` (with `texts` it is TEI's form: tei_api.py).

    {"model": "rerank", "query": "...", "documents": ["..." or {"text": "..."}], "top_n": 3,
     "return_documents": false}
 -> {"id", "results": [{"index", "relevance_score", "document": {"text"}?}] best first, "meta"}
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from starlette.requests import Request

from pergola.errors import StringLimits, read_strings
from pergola.gateway.errors import GatewayError
from pergola.gateway.http import Body, read_body
from pergola.gateway.state import Gateway


def best_first(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Indices by score, highest first; equal scores keep input order."""
    order = np.argsort(-scores, kind="stable")
    return order[:top_n].tolist() if top_n is not None else order.tolist()


async def scores_of(gw: Gateway, body: Body, documents_field: str, truncate: bool | None) -> tuple[list[str], np.ndarray]:
    """(documents, scores) for a rerank body, checked against the model's limits first."""
    model = await gw.model(body.get("model", str), "rerank")
    query_limit = model.limit("max_query_chars")
    [query] = read_strings([body.get("query", str, required=True)], "query", "query",
                           StringLimits(1, query_limit, query_limit, "max_query_chars"))
    raw = body.get(documents_field, list, required=True)
    docs = [d.get("text") if isinstance(d, dict) else d for d in raw]
    if not all(isinstance(d, str) for d in docs):
        raise GatewayError(422, f"`{documents_field}` must be strings (or objects with a `text` string)",
                           documents_field)
    docs = read_strings(docs, documents_field, "document", model.text_limits("max_documents"), used_chars=len(query))
    return docs, await gw.backend.rerank(model, query, docs, truncate)


async def rerank(gw: Gateway, body: Body) -> dict[str, Any]:
    docs, scores = await scores_of(gw, body, "documents", body.get("truncate", bool))
    top_n = body.positive("top_n")
    with_docs = body.get("return_documents", bool, False)
    results = []
    for i in best_first(scores, top_n):
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if with_docs:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": str(uuid.uuid4()), "model": body.get("model", str) or "rerank", "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}}


async def rerank_route(gw: Gateway, request: Request) -> dict[str, Any]:
    return await rerank(gw, await read_body(request, gw.opts.max_body_bytes))
