"""vLLM's pooling API: its fields on /v1/embeddings and the rerank routes, `POST /score`, its
/tokenize and /detokenize forms; each field is honoured, or refused with 400 naming it.

    /v1/embeddings  truncate_prompt_tokens (N keeps N tokens, -1 the model's limit; text or token
                    ids), truncation_side (right keeps the first N, left the last N), use_activation
                    (false: no L2 normalisation), embed_dtype float32 | float16 | bfloat16 and
                    endianness native | little | big (the bytes of base64), add_special_tokens true
    rerank          use_activation (false: the logits), truncate_prompt_tokens -1 (the model's limit)
    /score          {"model", "queries" | "text_1" | "data_1", "documents" | "items" | "text_2" |
                    "data_2", "use_activation"} -> {"id", "object": "list", "created", "model",
                    "data": [{"index", "object": "score", "score"}], "usage"}: one first text against
                    each second one (1:N) or pair by pair (N:N); a rerank model's scores, an
                    embedding model's cosine similarities
    /tokenize       {"prompt", "add_special_tokens", "return_token_strs"} -> {"count",
                    "max_model_len", "tokens", "token_strs"}
    /detokenize     {"tokens"} -> {"prompt"}

What pergola cannot do is refused: chat `messages`, fp8 embed dtypes, the bytes encodings,
`add_special_tokens: false`, padding to max_length, a priority other than 0, and on rerank a
truncate_prompt_tokens below the model's limit (send max_tokens_per_doc). `user`, `request_id`
and `cache_salt` (pergola keeps no prefix cache) change nothing.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.requests import Request

from pergola.gateway import tokenizers
from pergola.gateway.backend import EmbedRequest, RerankRequest
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import GatewayError, bad_request
from pergola.gateway.http import Body
from pergola.gateway.offload import TokenIds
from pergola.gateway.state import Gateway
from pergola.text.errors import quote, read_strings

EMBED_DTYPES = ("float32", "float16", "bfloat16")  # vLLM's fp8_e4m3 / fp8_e5m2: refused
ENDIANNESS = {"native": "=", "little": "<", "big": ">"}
# vLLM fields pergola cannot honour: name -> (the values that ask nothing of it, what to do instead)
UNSUPPORTED = {
    "messages": ((), "send the texts as `input` (pergola applies no chat template)"),
    "chat_template": ((), "pergola applies no chat template"),
    "chat_template_kwargs": ((), "pergola applies no chat template"),
    "add_generation_prompt": ((False,), "pergola applies no chat template"),
    "continue_final_message": ((False,), "pergola applies no chat template"),
    "add_special_tokens": ((True,), "texts are always tokenized with the model's special tokens; send token ids "
                                    "to choose every token"),
    "padding": (("do_not_pad",), "sequences are never padded (ragged batches)"),
    "priority": ((0,), "requests are served first come first served (queries in a lane of their own)"),
    "mm_processor_kwargs": ((), "pergola serves text models"),
}


def refuse_unsupported(body: Body, names: tuple[str, ...] = tuple(UNSUPPORTED)) -> None:
    """400 naming the first vLLM field in `names` that asks what pergola cannot do."""
    for name in names:
        value = body.data.get(name)
        fine, instead = UNSUPPORTED[name]
        if value is not None and not (value in fine and type(value) is type(fine[0])):
            raise bad_request(f"`{name}`={quote(value)} is not supported: {instead}", name)


def choice(body: Body, name: str, allowed: tuple[str, ...] | dict[str, Any], default: str) -> str:
    """A string field that must be one of `allowed` (400 naming it and the bad value otherwise)."""
    value = body.get(name, str, default)
    if value not in allowed:
        raise bad_request(f"`{name}` must be one of {', '.join(allowed)}, got {quote(value)}", name)
    return value


def use_activation(body: Body, exclusive: str) -> bool | None:
    """vLLM's `use_activation` (None: the model's default), refused beside the field it duplicates."""
    value = body.get("use_activation", bool)
    if value is not None and body.data.get(exclusive) is not None:
        raise bad_request(f"send `use_activation` or `{exclusive}`, not both", "use_activation")
    return value


def prompt_tokens(body: Body, model: ServedModel) -> int | None:
    """`truncate_prompt_tokens`: N (1 .. the model's limit), -1 for the model's limit; None when absent."""
    value = body.data.get("truncate_prompt_tokens")
    if value is None:
        return None
    longest = model.max_input_length
    if type(value) is not int or value < -1 or value == 0:
        raise bad_request(f"`truncate_prompt_tokens` must be -1 (the model's limit) or a positive integer, "
                          f"got {quote(value)}", "truncate_prompt_tokens")
    if longest is not None and value > longest:
        raise bad_request(f"`truncate_prompt_tokens`={value} is more than this model's limit of {longest} tokens; "
                          "send a smaller truncation size (or -1 for the model's limit)", "truncate_prompt_tokens")
    return longest if value == -1 else value


def check_max_tokens(opts: EmbedRequest, model: ServedModel) -> None:
    """A `max_tokens` above the model's limit is refused: cut to the limit, the caller would
    believe longer texts were embedded whole."""
    longest = model.max_input_length
    if opts.max_tokens is not None and longest is not None and opts.max_tokens > longest:
        raise bad_request(f"`max_tokens`={opts.max_tokens} is more than this model's limit of {longest} tokens; "
                          f"send at most {longest} (or leave it out for the model's limit)", "max_tokens")


@dataclass(frozen=True)
class Pooling:
    """What vLLM's fields ask of one /v1/embeddings request."""

    keep: int | None = None  # truncate_prompt_tokens (None: not asked; -1 resolved to the limit)
    side: str = "END"  # END keeps the first `keep` tokens, START the last
    normalize: bool | None = None  # use_activation
    dtype: str = "float32"  # embed_dtype: what base64 carries
    byteorder: str = "="  # endianness

    @classmethod
    def of(cls, body: Body, model: ServedModel) -> Pooling:
        if body.data.keys().isdisjoint(POOLING_FIELDS):  # (most requests: 0.3 us, not the 30 us of reading each)
            return NO_POOLING
        refuse_unsupported(body)
        keep = prompt_tokens(body, model)
        side = "START" if choice(body, "truncation_side", ("right", "left"), "right") == "left" else "END"
        if keep is not None:
            for other in ("truncate", "max_tokens"):
                if body.data.get(other) is not None:
                    raise bad_request(f"send `truncate_prompt_tokens` or `{other}`, not both", "truncate_prompt_tokens")
        dtype = choice(body, "embed_dtype", EMBED_DTYPES, "float32")
        if dtype != "float32" and body.data.get("embedding_type", "float") != "float":
            raise bad_request("send `embed_dtype` or `embedding_type`, not both", "embed_dtype")
        return cls(keep, side, use_activation(body, "normalize"), dtype,
                   ENDIANNESS[choice(body, "endianness", ENDIANNESS, "native")])

    def options(self, opts: EmbedRequest, model: ServedModel, token_ids: bool) -> EmbedRequest:
        """`opts` with what these fields ask (texts are cut by the tokenizer, token ids by `cut`)."""
        if self is NO_POOLING and opts.max_tokens is None:
            return opts
        if self.normalize is not None:
            opts = replace(opts, normalize=self.normalize)
        if self.keep is not None and not token_ids:
            opts = replace(opts, truncate=self.side, max_tokens=self.keep)
        check_max_tokens(opts, model)
        return opts

    def cut(self, ids: TokenIds) -> TokenIds:
        """Each token-id list cut to `keep` ids (its first, or its last with truncation_side left)."""
        if self.keep is None or not (ids.lengths > self.keep).any():
            return ids
        offsets = ids.offsets()
        kept = np.minimum(ids.lengths, self.keep)
        starts = offsets[:-1] if self.side == "END" else offsets[1:] - kept
        index = np.concatenate([np.arange(a, a + n) for a, n in zip(starts.tolist(), kept.tolist())])
        return TokenIds(ids.flat[index], kept.astype(np.int32))

    @property
    def native_floats(self) -> bool:
        """Whether base64 carries float32 in this machine's byte order (nothing for `wire` to do)."""
        return self.dtype == "float32" and self.byteorder in ("=", sys_order())

    def wire(self, values: np.ndarray) -> np.ndarray:
        """Float rows as base64 carries them: embed_dtype's values in the asked byte order
        (bfloat16: the top 16 bits of each float32, rounded to nearest even)."""
        if values.dtype != np.float32 or self.native_floats:
            return values
        if self.dtype == "bfloat16":
            bits = values.view(np.uint32)
            values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        elif self.dtype == "float16":
            values = values.astype(np.float16)
        return values.astype(values.dtype.newbyteorder(self.byteorder), copy=False)


NO_POOLING = Pooling()
POOLING_FIELDS = frozenset({*UNSUPPORTED, "truncate_prompt_tokens", "truncation_side", "use_activation",
                            "embed_dtype", "endianness"})


def sys_order() -> str:
    return "<" if sys.byteorder == "little" else ">"


def rerank_fields(body: Body, model: ServedModel) -> bool | None:
    """vLLM's fields on a rerank body: `use_activation` (returned: None = the route's default),
    `truncate_prompt_tokens` only as the model's own limit (documents are cut with max_tokens_per_doc)."""
    refuse_unsupported(body, ("priority", "mm_processor_kwargs", "add_special_tokens"))
    keep = prompt_tokens(body, model)
    if keep is not None and model.max_input_length is not None and keep < model.max_input_length:
        raise bad_request(f"`truncate_prompt_tokens`={keep} is not supported on rerank: pergola cuts documents, "
                          "not pairs; send `max_tokens_per_doc`", "truncate_prompt_tokens")
    return use_activation(body, "raw_scores")


# --- /score -------------------------------------------------------------------------------------

_SCORE_FIELDS = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))


def score_pairs(body: Body) -> tuple[str, str, list[str], list[str]]:
    """(first field, second field, first texts, second texts) of a /score body, 1:N or N:N."""
    for first, second in _SCORE_FIELDS:
        if first in body.data and second in body.data:
            break
    else:
        raise bad_request("send `queries` and `documents` (or `text_1` and `text_2`, `data_1` and `data_2`, "
                          "`queries` and `items`)", "queries")
    a, b = (body.get(name, (str, list), required=True) for name in (first, second))
    a, b = ([x] if isinstance(x, str) else x for x in (a, b))
    for name, texts in ((first, a), (second, b)):
        if not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request(f"`{name}` must be a string or a non-empty list of strings", name)
    if len(a) != 1 and len(a) != len(b):
        raise bad_request(f"`{first}` has {len(a)} texts and `{second}` {len(b)}: send one {first[:-1]} "
                          "for all, or as many as there are", first)
    return first, second, a, b


async def score(gw: Gateway, request: Request) -> dict[str, Any]:
    """vLLM's /score: a rerank model's score of each pair (sigmoid unless use_activation is
    false), or an embedding model's cosine similarity of the two texts."""
    body = await gw.body(request)
    name = body.get("model", str)
    catalog = await gw.catalog()
    task = catalog[name].task if name in catalog else "rerank"
    model = await gw.model(name, "embed" if task == "embed" else "rerank")
    first, second, a, b = score_pairs(body)
    if model.task == "embed":
        refuse_unsupported(body, ("priority", "mm_processor_kwargs"))
        texts = read_strings([*a, *b], first, "text", model.text_limits())
        keep = prompt_tokens(body, model)
        opts = EmbedRequest(normalize=True, truncate="END" if keep else None, max_tokens=keep)
        out = await gw.backend.embed(model, texts, opts)
        left, right = out.vectors[: len(a)], out.vectors[len(a):]
        scores = (np.repeat(left, len(b), 0) if len(a) == 1 else left) * right
        values, tokens = scores.sum(axis=1), int(out.tokens.sum())
    else:
        raw = rerank_fields(body, model) is False
        groups = [(a[0], list(range(len(b))))] if len(a) == 1 else [(q, [i]) for i, q in enumerate(a)]
        opts = RerankRequest(truncate="END" if prompt_tokens(body, model) else None, raw_scores=raw)
        parts = await asyncio.gather(*(gw.backend.rerank(model, q, read_strings(
            [b[i] for i in index], second, "document", model.text_limits("max_documents")), opts)
            for q, index in groups))
        values = np.empty(len(b), dtype=np.float32)
        tokens = 0
        for (_, index), part in zip(groups, parts):
            values[index] = part.scores
            tokens += int(part.tokens.sum())
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.name,
            "data": [{"index": i, "object": "score", "score": float(v)} for i, v in enumerate(values.tolist())],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


# --- /tokenize {prompt} and /detokenize -----------------------------------------------------------

def is_vllm_tokenize(body: Body) -> bool:
    """A /tokenize body in vLLM's form (`prompt`), not TEI's (`inputs`)."""
    return "prompt" in body.data or "messages" in body.data


def is_score(body: Body) -> bool:
    """A body in /score's form (queries and documents, text_1 and text_2, ...)."""
    return any(a in body.data and b in body.data for a, b in _SCORE_FIELDS) and "query" not in body.data


def tokenize_prompt(folder: str, prompt: str, add_special_tokens: bool) -> list[Any]:
    """(ids, token strings) of `prompt` with the served version's tokenizer (in a CPU worker)."""
    encoding = tokenizers.raw(folder).encode(prompt, add_special_tokens=add_special_tokens)
    return [encoding.ids, encoding.tokens]


async def tokenize(gw: Gateway, body: Body) -> dict[str, Any]:
    """vLLM's /tokenize form: the prompt's ids, as the served model's tokenizer makes them (any
    served model: `embed` unless the body names one)."""
    name = body.get("model", str)
    catalog = await gw.catalog()
    model = await gw.model(name, catalog[name].task if name in catalog else "embed")
    refuse_unsupported(body, ("messages", "chat_template", "chat_template_kwargs"))
    prompt = body.get("prompt", str, required=True)
    [prompt] = read_strings([prompt], "prompt", "text", model.text_limits())
    add_special = body.get("add_special_tokens", bool, True)
    folder = gw.backend.tokenizers.folder(model)
    if folder is not None:
        ids, pieces = await gw.offload.run(tokenize_prompt, str(folder), prompt, add_special)
    else:
        out = await gw.backend.tokenize(model, [prompt], None, add_special)
        ids, pieces = out.ids.tolist(), [p.decode("utf-8") for p in out.pieces]
    return {"count": len(ids), "max_model_len": model.max_input_length, "tokens": ids,
            "token_strs": pieces if body.get("return_token_strs", bool, False) else None}


def decode_here(folder: str, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """Token-id lists as text, with the served version's tokenizer (in a CPU worker)."""
    return tokenizers.raw(folder).decode_batch(ids, skip_special_tokens=skip_special_tokens)


async def decode(gw: Gateway, model: ServedModel, ids: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """The texts of token-id lists (TEI's /decode, vLLM's /detokenize): needs the repository's
    files (--triton-repository; `pergola serve` passes it)."""
    folder = gw.backend.tokenizers.folder(model)
    if folder is None:
        raise GatewayError(501, "decoding token ids needs the model's tokenizer files: start the gateway with "
                                "--triton-repository (`pergola serve` does)")
    return await gw.offload.run(decode_here, str(folder), ids, skip_special_tokens)


async def detokenize(gw: Gateway, request: Request) -> dict[str, Any]:
    body = await gw.body(request)
    model = await gw.model(body.get("model", str), "embed")
    ids = body.get("tokens", list, required=True)
    if not all(type(i) is int and 0 <= i < 2**31 for i in ids):
        raise bad_request("`tokens` must be a list of token ids", "tokens")
    [text] = await decode(gw, model, [ids], False)
    return {"prompt": text}
