"""text-embeddings-inference's API: `POST /embed`, `POST /rerank` (`texts`), `POST /predict`,
`POST /similarity`, `POST /tokenize`, `POST /decode`, `POST /vertex`, `POST /` (by the body and
the served model's task, as TEI routes it), `GET /info`, `GET /health` (and `/ping`, `GET /`);
errors as {"error", "error_type"}.

    /embed   {"inputs": "..." or [...], "normalize": true, "truncate": null, "truncation_direction":
              "Right", "prompt_name": null, "dimensions": null}  ->  [[float, ...], ...]
    /rerank  {"query", "texts", "return_text": false, "raw_scores": false, "truncate": null,
              "truncation_direction": "Right"}  ->  [{"index", "score", "text"?}] best first

    /predict {"inputs": "..." | ["a", "b"] (a pair) | [["a"], ["b", "c"], ...] (a batch),
              "raw_scores": false, "truncate": null, "truncation_direction": "Right"}
             ->  [{"label", "score"}] best first, or one such list per input of a batch

    /embed_sparse  {"inputs", "truncate", "truncation_direction", "prompt_name"}
             ->  [[{"index": token id, "value": weight}, ...], ...]  bge-m3's lexical weights
    /embed_all {same}  ->  [[[float, ...] per token], ...]  bge-m3's ColBERT vectors (every token but
              CLS, L2-normalised); TEI answers a model's raw last hidden states here, pergola the
              vectors bge-m3 is scored with. Other models refuse both (400, naming what they give).

    /similarity {"inputs": {"source_sentence", "sentences": [...]}, "parameters": {"truncate",
              "truncation_direction", "prompt_name"}}  ->  [cosine of each sentence with the source]
    /decode  {"ids": [id, ...] or [[id, ...], ...], "skip_special_tokens": true}  ->  ["text", ...]
    /vertex  {"instances": [a /rerank body, or an /embed body (a /predict body for a classifier)]}
             ->  {"predictions": [each one's answer]}

`raw_scores: true` answers the logit (a cross-encoder's before its sigmoid, a Qwen3-Reranker's
logit(yes) - logit(no)) instead of sigmoid(logit).

`chunking` on /embed cuts long texts into windows (gateway/chunking.py).

`truncate: true` cuts a text over the limit at its end (`truncation_direction: Right`) or its
start (`Left`); `false` refuses it with TEI's 413; left out, the model's default (`--truncate`)
holds. Token counts come back in the `x-total-tokens` header.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from pergola.config.hf_folder import ModelFolderError
from pergola.gateway import connections, rerank_api, tokenizers, vllm_api
from pergola.gateway.backend import ClassifyRequest, EmbedRequest, PerToken, TooLong
from pergola.gateway.catalog import ServedModel
from pergola.gateway.chunking import chunking_option, tei_chunked
from pergola.gateway.errors import GatewayError, bad_request
from pergola.gateway.http import Body, JSONResponse, Keys, answer, error_response
from pergola.gateway.offload import as_is
from pergola.gateway.state import Gateway
from pergola.outputs.token_outputs import check_outputs
from pergola.text.errors import RequestError, quote, read_strings

log = logging.getLogger("pergola.gateway")
VERSION = "pergola-gateway"


def _truncation(body: Body, model: ServedModel) -> str | None:
    """TEI's `truncate` + `truncation_direction` as a mode (None: the model's default)."""
    given = body.get("truncation_direction", str, "Right")
    direction = given.lower()
    if direction not in ("left", "right"):
        raise GatewayError(422, f"truncation_direction must be Left or Right, got {quote(given)}",
                           "truncation_direction")
    side = "START" if direction == "left" else "END"
    truncate = body.get("truncate", bool)
    if truncate is None:  # the model's default decides whether to cut, the request from which side
        return None if side == "END" else (side if model.limit("truncate") else "NONE")
    return side if truncate else "NONE"


def _too_long(e: TooLong, field: str) -> GatewayError:
    """TEI's answer to an input over the limit with truncation off."""
    return GatewayError(413, f"Input validation error: `{field}` must have less than {e.limit + 1} tokens. "
                             f"Given: more than {e.limit} ({field}[{e.index}]); send `truncate: true` to cut it",
                        field)


async def text_inputs(gw: Gateway, request: Request, task: str = "embed",
                      field: str = "inputs") -> tuple[Body, ServedModel, list[str]]:
    """A body of texts for a `task` model: the body, the model it names, its `field` (a string or
    strings) checked against the limits."""
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), task)
    raw = body.get(field, (str, list), required=True)
    texts = [raw] if isinstance(raw, str) else raw
    if not all(isinstance(t, str) for t in texts):
        raise GatewayError(422, f"`{field}` must be a string or a list of strings", field)
    return body, model, read_strings(texts, field, "text", model.text_limits())


async def embed(gw: Gateway, request: Request) -> Response:
    body, model, texts = await text_inputs(gw, request)
    opts = EmbedRequest(prompt_name=body.get("prompt_name", str), dimensions=body.count("dimensions"),
                        normalize=body.get("normalize", bool, True), truncate=_truncation(body, model))
    chunking = chunking_option(body)
    if chunking is not None:  # long texts in windows (gateway/chunking.py)
        return await tei_chunked(gw, body, model, texts, opts, chunking)
    try:
        out = await gw.backend.embed(model, texts, opts)
    except TooLong as e:
        raise _too_long(e, "inputs") from None
    return await answer(gw.offload, out.vectors.size, as_is, out.vectors,
                        headers={"x-total-tokens": str(int(out.tokens.sum()))})


async def similarity(gw: Gateway, request: Request) -> JSONResponse:
    """TEI's /similarity (huggingface_hub's sentence_similarity): the cosine of each sentence's
    embedding with the source sentence's."""
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), "embed")
    inputs = body.get("inputs", dict, required=True)
    source, sentences = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str) or not isinstance(sentences, list) or not all(isinstance(t, str) for t in sentences):
        raise GatewayError(422, "`inputs` must be {\"source_sentence\": a string, \"sentences\": a list of strings}",
                           "inputs")
    if not sentences:
        raise GatewayError(400, "`inputs.sentences` cannot be empty", "inputs")
    parameters = Body(body.get("parameters", dict, {}))
    texts = read_strings([source, *sentences], "inputs", "text", model.text_limits())
    opts = EmbedRequest(prompt_name=parameters.get("prompt_name", str), normalize=True,
                        truncate=_truncation(parameters, model))
    try:
        out = await gw.backend.embed(model, texts, opts)
    except TooLong as e:
        raise _too_long(e, "inputs") from None
    return JSONResponse((out.vectors[1:] @ out.vectors[0]).tolist(), headers={"x-total-tokens": str(int(out.tokens.sum()))})


async def decode(gw: Gateway, request: Request) -> list[str]:
    """TEI's /decode: token-id lists as text (the served model's tokenizer)."""
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), "embed")
    ids = body.get("ids", list, required=True)
    lists = ids if ids and all(isinstance(x, list) for x in ids) else [ids]
    if not ids:
        raise GatewayError(400, "`ids` cannot be empty", "ids")
    if not all(type(i) is int and 0 <= i < 2**31 for x in lists for i in x):
        raise GatewayError(422, "`ids` must be a list of token ids or a list of such lists", "ids")
    if len(lists) > model.limit("max_texts"):
        raise GatewayError(422, f"batch size {len(lists)} > maximum allowed batch size {model.limit('max_texts')}",
                           "ids")
    return await vllm_api.decode(gw, model, lists, body.get("skip_special_tokens", bool, True))


async def _per_token(gw: Gateway, request: Request, output: str) -> tuple[PerToken, dict[str, str]]:
    """bge-m3's `output` (sparse | colbert) of a TEI body's inputs, and the x-total-tokens header."""
    body, model, texts = await text_inputs(gw, request)
    check_outputs([output], model.outputs)  # (RequestError: 400, naming what the model gives)
    opts = EmbedRequest(prompt_name=body.get("prompt_name", str), truncate=_truncation(body, model))
    try:
        out = await gw.backend.per_token(model, texts, [output], opts)
    except TooLong as e:
        raise _too_long(e, "inputs") from None
    return out, {"x-total-tokens": str(int(out.tokens.sum()))}


def sparse_answer(sparse: list[tuple[np.ndarray, np.ndarray]]) -> list[list[dict[str, Any]]]:
    """/embed_sparse's answer: per text, {index: token id, value: weight} for each of its ids."""
    return [[{"index": i, "value": v} for i, v in zip(ids.tolist(), values.tolist())] for ids, values in sparse]


async def embed_sparse(gw: Gateway, request: Request) -> Response:
    """TEI's /embed_sparse: each input's lexical weights, {index: token id, value}, ids ascending."""
    out, headers = await _per_token(gw, request, "sparse")
    return await answer(gw.offload, sum(len(ids) for ids, _ in out.sparse), sparse_answer, out.sparse,
                        headers=headers)


async def embed_all(gw: Gateway, request: Request) -> Response:
    """TEI's /embed_all: each input's token vectors (bge-m3's ColBERT vectors)."""
    out, headers = await _per_token(gw, request, "colbert")
    return await answer(gw.offload, sum(v.size for v in out.colbert), as_is, out.colbert, headers=headers)


async def tei_rerank(gw: Gateway, body: Body) -> JSONResponse:
    model = await gw.model(body.get("model", str), "rerank")
    opts = rerank_api.rerank_request(body, _truncation(body, model), raw_scores=body.get("raw_scores", bool, False))
    try:
        texts, out = await rerank_api.scores_of(gw, body, "texts", opts)
    except TooLong as e:
        raise _too_long(e, "texts") from None
    with_text = body.get("return_text", bool, False)
    return JSONResponse([{"index": i, "score": float(out.scores[i]), **({"text": texts[i]} if with_text else {})}
                         for i in rerank_api.best_first(out.scores, None)],
                        headers={"x-total-tokens": str(int(out.tokens.sum()))})


def _sequences(raw: object) -> tuple[list[str], list[str | None], bool]:
    """TEI's /predict `inputs` -> (texts, each text's pair or None, whether it was a batch): a
    string or a list of one or two strings is one input, a list of such lists a batch."""
    def sequence(item: object) -> tuple[str, str | None]:
        if isinstance(item, list) and len(item) in (1, 2) and all(isinstance(s, str) for s in item):
            return item[0], item[1] if len(item) == 2 else None
        raise GatewayError(422, "`inputs` must be a string, a pair [\"text\", \"text pair\"], or a batch of "
                                "those as lists: [[\"text\"], [\"text\", \"text pair\"]]", "inputs")

    if isinstance(raw, str):
        return [raw], [None], False
    if isinstance(raw, list) and raw and all(isinstance(s, str) for s in raw):
        first, second = sequence(raw)
        return [first], [second], False
    items = [sequence(item) for item in raw] if isinstance(raw, list) else [sequence(raw)]
    return [a for a, _ in items], [b for _, b in items], True


async def predict(gw: Gateway, request: Request) -> Any:
    """TEI's /predict: each input's labels with their probabilities (logits with raw_scores), best first."""
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), "classify")
    texts, pairs, batched = _sequences(body.get("inputs", (str, list), required=True))
    texts = read_strings(texts, "inputs", "text", model.text_limits())
    seconds = [p for p in pairs if p is not None]
    if seconds:
        read_strings(seconds, "inputs", "text pair", model.text_limits(), used_chars=sum(map(len, texts)))
    opts = ClassifyRequest(truncate=_truncation(body, model), raw_scores=body.get("raw_scores", bool, False))
    try:
        out = await gw.backend.classify(model, texts, pairs, opts)
    except TooLong as e:
        raise _too_long(e, "inputs") from None
    predictions = [[{"score": float(row[j]), "label": out.labels[j]} for j in np.argsort(-row, kind="stable")]
                   for row in out.probs]
    return JSONResponse(predictions if batched else predictions[0],
                        headers={"x-total-tokens": str(int(out.tokens.sum()))})


def with_body(request: Request, body: Body) -> Request:
    """`request` carrying `body` as its parsed body (gateway.body reads it): one /vertex instance."""
    return Request({**request.scope, "state": {"body": body}})


async def root_handler(gw: Gateway, request: Request) -> tuple[str, Any]:
    """What TEI's `POST /` (and SageMaker's /invocations in TEI's form) runs for this body: a
    rerank body ({"query", "texts"}) reranks, a similarity body ({"inputs": {"source_sentence",
    ...}}) compares; otherwise the served model's task decides, as TEI routes `/` by its one
    model: `embed` if there is one (or the body's `model`), else a classifier's /predict."""
    body = await gw.body(request)
    if "query" in body.data and "texts" in body.data:
        return "rerank", lambda: tei_rerank(gw, body)
    if isinstance(body.data.get("inputs"), dict):
        return "similarity", lambda: similarity(gw, request)
    catalog = await gw.catalog()
    name = body.get("model", str)
    task = catalog[name].task if name in catalog else "embed" if "embed" in catalog or not catalog else "classify"
    if task == "rerank":
        raise bad_request("this model reranks: send {\"query\", \"texts\"}", "texts")
    return task, lambda: embed(gw, request) if task == "embed" else predict(gw, request)


async def root(gw: Gateway, request: Request) -> Any:
    _, run = await root_handler(gw, request)
    return await run()


async def vertex(gw: Gateway, request: Request) -> dict[str, Any]:
    """TEI's /vertex (Vertex AI's prediction form): each instance answered as `POST /` would."""
    body = await gw.body(request)
    instances = body.get("instances", list, required=True)
    if not instances or not all(isinstance(i, dict) for i in instances):
        raise GatewayError(422, "`instances` must be a non-empty list of request bodies", "instances")

    async def one(instance: dict) -> Any:
        answer = await root(gw, with_body(request, Body(instance)))
        return orjson.loads(answer.body) if isinstance(answer, Response) else answer

    return {"predictions": [await one(instance) for instance in instances]}


async def rerank_either(gw: Gateway, keys: Keys, request: Request) -> Response:
    """`/rerank` speaks TEI when the body has `texts`, Cohere/Jina when it has `documents` (the
    key is checked once the body says which envelope an error goes in)."""
    family = "cohere"
    try:
        body = await gw.body(request)
        family = "tei" if "texts" in body.data else "cohere"
        keys.check(request)
        if family == "tei":
            return await tei_rerank(gw, body)
        return JSONResponse(await rerank_api.rerank(gw, body))
    except (GatewayError, RequestError) as e:
        return error_response(e, family)


TOKENS_PER_PART = 65_536  # /tokenize renders this many tokens at a time (their dicts live at once)


def tokens_json(ids: np.ndarray, lengths: np.ndarray, pieces: Sequence[str | bytes], offsets: np.ndarray) -> bytes:
    """TEI's /tokenize answer: per text, its tokens as {id, text, special, start, stop}. Rendered
    TOKENS_PER_PART at a time: a million tokens as dicts at once would hold ~250 MB."""
    def part(a: int, b: int) -> bytes:
        return orjson.dumps([
            {"id": i, "text": p if isinstance(p, str) else p.decode("utf-8"), "special": start < 0,
             "start": None if start < 0 else start, "stop": None if start < 0 else stop}
            for i, p, (start, stop) in zip(ids[a:b].tolist(), pieces[a:b], offsets[a:b].tolist())])[1:-1]

    texts, start = [], 0
    for n in lengths.tolist():
        parts = [part(a, min(a + TOKENS_PER_PART, start + n)) for a in range(start, start + n, TOKENS_PER_PART)]
        texts.append(b"[" + b",".join(parts) + b"]")
        start += n
    return b"[" + b",".join(texts) + b"]"


def tokenize_here(model: ServedModel, folder: str, texts: list[str], prompt_name: str | None,
                  add_special_tokens: bool) -> bytes:
    """/tokenize's answer made in a CPU worker (gateway/offload.py) with the served version's
    files: the tokens as NAME_tokenizer makes them, rendered."""
    tokens = tokenizers.loaded(model, folder).tokenize(texts, prompt_name, add_special_tokens)
    return tokens_json(tokens.input_ids, tokens.lengths, tokens.pieces, tokens.offsets)


async def tokenize(gw: Gateway, request: Request) -> Any:
    """TEI's /tokenize: each input's tokens as the served model's tokenizer makes them (its
    prompt first, untruncated): {id, text, special, start, stop}, offsets in characters. With the
    repository at hand a CPU worker tokenizes and renders (nothing of it on the event loop), else
    NAME_tokenizer tokenizes. Over --max-tokenize-chars: 413 before any work. A body with `prompt`
    is vLLM's form (vllm_api.tokenize)."""
    body = await gw.body(request)
    if vllm_api.is_vllm_tokenize(body):
        return await vllm_api.tokenize(gw, body)
    body, model, texts = await text_inputs(gw, request)
    chars, limit = sum(map(len, texts)), gw.opts.max_tokenize_chars
    if chars > limit:
        raise GatewayError(413, f"/tokenize of {chars:,} characters; the limit is {limit:,} (--max-tokenize-chars): "
                                f"its answer, an object per token, would take ~{chars * 14 / 1e6:,.0f} MB of JSON "
                                f"(up to ~{chars * 64 / 1e6:,.0f} MB); send fewer or shorter texts", "inputs")
    prompt_name, add_special = body.get("prompt_name", str), body.get("add_special_tokens", bool, True)
    folder = gw.backend.tokenizers.folder(model)
    if folder is not None:
        try:
            content = await gw.offload.run(tokenize_here, model, str(folder), texts, prompt_name, add_special)
            return Response(content, media_type=JSONResponse.media_type)
        except (OSError, ModelFolderError) as e:  # (that version's files are gone: Triton's tokenizer has the new one)
            log.warning("cannot tokenize %s in the gateway, asking Triton's tokenizer: %s", model.name, e)
            gw.backend.tokenizers.stale(model)
    out = await gw.backend.tokenize(model, texts, prompt_name, add_special)
    return await answer(gw.offload, len(out.ids), tokens_json, out.ids, out.lengths, out.pieces, out.offsets)


async def info(gw: Gateway, request: Request) -> dict[str, Any]:
    """What TEI's /info says (its fields, TEI's meanings), for the default model of each task (or
    ?model=NAME); pergola's own beside them (served_name, models, prompts, attention_backend)."""
    catalog = await gw.catalog()
    name = request.query_params.get("model") or next((n for n in ("embed", "rerank", "classify") if n in catalog),
                                                     None)
    if name not in catalog:
        raise GatewayError(503 if not catalog else 404, "no model is served yet" if not catalog
                           else f"model {name!r} is not served here")
    model = catalog[name]
    settings = model.settings
    labels = {"0": "score"} if model.task == "rerank" else {str(i): label for i, label in enumerate(model.labels)}
    kind = {"embed": {"embedding": {"pooling": settings.get("pooling") or "model default"}},
            "rerank": {"reranker": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}},
            "classify": {"classifier": {"id2label": labels, "label2id": {v: int(k) for k, v in labels.items()}}},
            }[model.task]
    return {"model_id": model.target, "model_sha": settings.get("model_revision"), "model_dtype": model.dtype,
            "served_model_name": name, "model_type": kind,
            "max_concurrent_requests": _max_concurrent(gw),
            "max_input_length": model.max_input_length, "max_batch_tokens": model.step_tokens,
            "max_batch_requests": model.limit("max_batch_seqs"),
            "max_client_batch_size": model.limit("max_documents" if model.task == "rerank" else "max_texts"),
            "auto_truncate": bool(model.limit("truncate")), "tokenization_workers": model.tokenizer_instances,
            "version": VERSION, "sha": None, "docker_label": None,
            "served_name": name, "hub_id": settings.get("model_id"),  # pergola.config.hub
            "attention_backend": settings.get("attention_backend", "auto"),
            "prompts": {k: v for k, v in (("query", settings.get("query_prompt")),
                                          ("document", settings.get("document_prompt"))) if v},
            "models": {n: m.task for n, m in catalog.items()}}


def _max_concurrent(gw: Gateway) -> int | None:
    """Requests in flight at most: each gateway process holds --max-connections connections
    (gateway/connections.py), each one request at a time; None where no limit was set up."""
    limits = getattr(connections.GuardedProtocol, "limits", None)
    return limits.max_connections * gw.opts.gateway_workers if limits is not None else None


async def health(gw: Gateway, request: Request) -> Response:
    """200 when a Triton replica is ready and serves a model; 503 otherwise (no key needed).
    ?model=NAME: that model's own readiness, 503 + Retry-After while `pergola serve` loads it
    again after one of its processes died (the others stay ready; gateway/state.py Recovering)."""
    name = request.query_params.get("model")
    if not (await gw.pool.ready() and await gw.catalog()):
        return JSONResponse({"error": "no Triton replica is ready", "error_type": "Unhealthy"}, status_code=503)
    if name is not None:
        model = (await gw.catalog()).get(name)
        if model is None:
            raise GatewayError(404, f"model {name[:200]!r} is not served here", "model")
        if gw.recovering.of(model):
            raise GatewayError(503, f"model {name!r} is being loaded again after a process of it stopped "
                                    f"({', '.join(gw.recovering.of(model))}); retry shortly")
    return Response(status_code=200)
