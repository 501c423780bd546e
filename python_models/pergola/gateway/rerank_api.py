"""Reranking in Cohere's and Jina's form: `POST /v1/rerank`, `/v2/rerank`, and `/rerank` when
the body has `documents` (with `texts` it is TEI's form: tei_api.py); NVIDIA NIM's `POST /v1/ranking`.

    {"model": "rerank", "query": "...", "documents": ["..." or {"text": "..."}], "top_n": 3,
     "return_documents": false, "max_tokens_per_doc": 4096}
 -> {"id", "results": [{"index", "relevance_score", "document": {"text"}?}] best first, "meta",
     "usage": {"prompt_tokens", "total_tokens"}}

`max_tokens_per_doc` (Cohere's) cuts each document to that many tokens; vLLM's `use_activation`
(false: the logits) and `truncate_prompt_tokens` (-1) are honoured (vllm_api.py); pergola's extras:
`truncate` (NONE, START, END or a boolean, which end of a document is cut) and `instruction`
(a Qwen3-Reranker's task). `usage.total_tokens` (Jina's and vLLM's) counts every (query,
document) pair's tokens as the encoder ran them; `usage.prompt_tokens` (vLLM's) the same.

    NIM: {"model", "query": {"text"}, "passages": [{"text"}], "truncate": "NONE" | "END"}
 -> {"rankings": [{"index", "logit"}] best first, "usage": {"total_tokens"}}: raw scores (a
    cross-encoder's logit, a Qwen3-Reranker's logit(yes) - logit(no)), as NIM answers.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from starlette.requests import Request

from pergola.gateway.backend import Reranked, RerankRequest, TooLong
from pergola.gateway.errors import GatewayError
from pergola.gateway.http import Body
from pergola.gateway.openai_api import too_long, truncate_option
from pergola.gateway.state import Gateway
from pergola.gateway.vllm_api import rerank_fields
from pergola.text.errors import StringLimits, read_strings


def best_first(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Indices by score, highest first; equal scores keep input order."""
    order = np.argsort(-scores, kind="stable")
    return order[:top_n].tolist() if top_n is not None else order.tolist()


def rerank_request(body: Body, truncate: str | None, max_document_tokens: str | None = None,
                   raw_scores: bool = False) -> RerankRequest:
    """What a rerank body asks beyond query and documents (`truncate`: the mode, as its API sends it;
    `raw_scores`: logits rather than their sigmoid)."""
    return RerankRequest(truncate=truncate, instruction=body.get("instruction", str), raw_scores=raw_scores,
                         max_document_tokens=body.count(max_document_tokens) if max_document_tokens else None)


async def scores_of(gw: Gateway, body: Body, documents_field: str,
                    opts: RerankRequest) -> tuple[list[str], Reranked]:
    """(documents, scores and tokens) for a rerank body, checked against the model's limits first
    (a document over the token limit with truncation off: TooLong, which each API words)."""
    model = await gw.model(body.get("model", str), "rerank")
    query_limit = model.limit("max_query_chars")
    query = body.get("query", (str, dict), required=True)
    if isinstance(query, dict):  # NIM's {"text": ...}
        query = query.get("text")
        if not isinstance(query, str):
            raise GatewayError(422, "`query` must be a string or an object with a `text` string", "query")
    [query] = read_strings([query], "query", "query", StringLimits(1, query_limit, query_limit, "max_query_chars"))
    raw = body.get(documents_field, list, required=True)
    docs = [d.get("text") if isinstance(d, dict) else d for d in raw]
    if not all(isinstance(d, str) for d in docs):
        raise GatewayError(422, f"`{documents_field}` must be strings (or objects with a `text` string)",
                           documents_field)
    docs = read_strings(docs, documents_field, "document", model.text_limits("max_documents"), used_chars=len(query))
    return docs, await gw.backend.rerank(model, query, docs, opts)


async def rerank(gw: Gateway, body: Body) -> dict[str, Any]:
    model = await gw.model(body.get("model", str), "rerank")
    activation = rerank_fields(body, model)  # vLLM's use_activation, truncate_prompt_tokens (vllm_api.py)
    truncate = truncate_option(body) or ("END" if "truncate_prompt_tokens" in body.data else None)
    opts = rerank_request(body, truncate, "max_tokens_per_doc", raw_scores=activation is False)
    top_n = body.count("top_n")  # (more than the documents: all of them, as Cohere answers)
    with_docs = body.get("return_documents", bool, False)
    try:
        docs, out = await scores_of(gw, body, "documents", opts)
    except TooLong as e:
        raise too_long(e, "documents", 'send "truncate": "END" (or "START") to cut it') from None
    scores = out.scores
    results = []
    for i in best_first(scores, top_n):
        item: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if with_docs:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": str(uuid.uuid4()), "model": body.get("model", str) or "rerank", "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}},
            "usage": {"prompt_tokens": int(out.tokens.sum()), "total_tokens": int(out.tokens.sum())}}


async def rerank_route(gw: Gateway, request: Request) -> dict[str, Any]:
    return await rerank(gw, await gw.body(request))


async def nim_ranking(gw: Gateway, request: Request) -> dict[str, Any]:
    """NIM's /v1/ranking: every passage's logit, best first (NIM's `truncate` is NONE or END)."""
    body = await gw.body(request)
    opts = rerank_request(body, truncate_option(body), raw_scores=True)
    try:
        _, out = await scores_of(gw, body, "passages", opts)
    except TooLong as e:
        raise too_long(e, "passages", 'send "truncate": "END" to cut it') from None
    return {"rankings": [{"index": i, "logit": float(out.scores[i])} for i in best_first(out.scores, None)],
            "usage": {"total_tokens": int(out.tokens.sum())}}
