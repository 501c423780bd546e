"""API cases ported from vLLM's and text-embeddings-inference's own test files (vLLM:
tests/entrypoints/pooling/embed/test_online.py, scoring/test_cross_encoder_online.py,
scoring/test_max_tokens_per_doc.py; TEI: router/tests/test_http_embed.rs and its snapshot, the
router's routes and error types), plus Cohere's embed forms, against `pergola serve`
(conftest.served_gateway): MiniLM as `mini`, the seeded cross-encoder as `ce`.

Each row: (name, path, body, status, check). A check gets the answer and a Context (token counts
and sentence-transformers vectors for MiniLM, further calls). Where pergola answers otherwise than
the peer on purpose, the row says so (a text over the limit is cut by the model's default
`truncate`, not refused)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import MIN_COSINE, cosine_rows
from test_gateway import call

pytestmark = pytest.mark.server
TEXT = "The best thing about vLLM is that it supports many different models"
PT = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
QUERY, DOCS = "What is the capital of France?", ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
TEXTS_1 = ["What is the capital of France?", "What is the capital of Germany?"]
TEXTS_2 = ["The capital of France is Paris.", "The capital of Germany is Berlin."]
# TEI's snapshot (router/tests/snapshots/test_http_embed__mrl_embeddings_single.snap): the first
# values of all-MiniLM-L6-v2's embedding of "test" cut to 128 dimensions and normalised
TEI_ATOL = 5e-4  # (TEI's candle kernels against PyTorch's: ~1e-4 apart; both at cosine 1.0000 to ST's)
TEI_MRL_TEST = [0.020964134, 0.04565805, -0.066505864, 0.10739273, -0.013054413, -0.07467599, 0.13989426, 0.06780755]


@dataclass
class Context:
    url: str
    key: str
    st_model: Any

    def call(self, path: str, body: object = None, method: str = "POST") -> tuple[int, Any, dict]:
        return call(self, method, path, body, key=self.key)

    def ids(self, text: str) -> list[int]:
        return self.st_model.tokenizer(text)["input_ids"]

    def tokens(self, text: str) -> int:
        return len(self.ids(text))

    def close(self, vectors: Any, texts: list[str], atol: float | None = None) -> bool:
        ref = self.st_model.encode(texts, convert_to_numpy=True)
        got = np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1)
        if atol is not None:
            return np.abs(got - ref).max() <= atol
        return cosine_rows(got, ref).min() >= MIN_COSINE


def b64(row: str, dtype: str) -> np.ndarray:
    """A base64 row as float32 (bfloat16: its 16 bits are a float32's top half)."""
    raw = base64.b64decode(row)
    if dtype.endswith("bf16"):
        return (np.frombuffer(raw, dtype=dtype[0] + "u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype=dtype).astype(np.float32)


def vectors(out: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in out["data"]], dtype=np.float32)


def message(out: Any) -> str:
    return json.dumps(out)


def refused(*words: str) -> Callable[[Any, Context], bool]:
    """An error whose message names each of `words` (the field, the bad value)."""
    return lambda out, ctx: all(w in message(out) for w in words)


def sorted_best_first(results: list[dict], key: str) -> bool:
    return [r[key] for r in results] == sorted((r[key] for r in results), reverse=True)


CASES: list[tuple[str, str, dict, int, Callable[[Any, Context], bool] | None]] = [
    # --- vLLM: /v1/embeddings (embed/test_online.py) ---
    ("vllm str input", "/v1/embeddings", {"model": "mini", "input": TEXT, "encoding_format": "float"}, 200,
     lambda o, c: len(o["data"]) == 1 and len(o["data"][0]["embedding"]) == 384
     and o["usage"]["prompt_tokens"] == o["usage"]["total_tokens"] == c.tokens(TEXT) and c.close(vectors(o), [TEXT])),
    ("vllm token ids input", "/v1/embeddings", {"model": "mini", "input": "IDS", "encoding_format": "float"}, 200,
     lambda o, c: o["usage"]["prompt_tokens"] == c.tokens(TEXT) and c.close(vectors(o), [TEXT])),
    ("vllm batched strings", "/v1/embeddings", {"model": "mini", "input": [TEXT] * 10}, 200,
     lambda o, c: len(o["data"]) == 10 and o["usage"]["prompt_tokens"] == 10 * c.tokens(TEXT)),
    ("vllm batched token ids", "/v1/embeddings", {"model": "mini", "input": ["IDS"] * 10}, 200,
     lambda o, c: len(o["data"]) == 10 and o["usage"]["prompt_tokens"] == 10 * c.tokens(TEXT)),
    ("vllm truncate_prompt_tokens text", "/v1/embeddings", {"model": "mini", "input": [PT], "truncate_prompt_tokens": 10},
     200, lambda o, c: o["usage"]["prompt_tokens"] == 10 and len(o["data"][0]["embedding"]) == 384),
    ("vllm truncate_prompt_tokens ids", "/v1/embeddings", {"model": "mini", "input": "PT_IDS", "truncate_prompt_tokens": 10},
     200, lambda o, c: o["usage"]["prompt_tokens"] == 10),
    ("vllm truncate_prompt_tokens left", "/v1/embeddings",
     {"model": "mini", "input": PT, "truncate_prompt_tokens": 10, "truncation_side": "left"}, 200,
     lambda o, c: o["usage"]["prompt_tokens"] == 10),
    ("vllm truncate_prompt_tokens -1", "/v1/embeddings", {"model": "mini", "input": PT, "truncate_prompt_tokens": -1},
     200, lambda o, c: o["usage"]["prompt_tokens"] == c.tokens(PT)),
    ("vllm truncate_prompt_tokens over the limit", "/v1/embeddings",
     {"model": "mini", "input": PT, "truncate_prompt_tokens": 8193}, 400,
     lambda o, c: o["error"]["param"] == "truncate_prompt_tokens" and "smaller truncation size" in message(o)),
    ("vllm base64 float32", "/v1/embeddings", {"model": "mini", "input": [TEXT, PT], "encoding_format": "base64"}, 200,
     lambda o, c: c.close([b64(d["embedding"], "<f4") for d in o["data"]], [TEXT, PT])),
    *[(f"vllm embed_dtype {dt} {end}", "/v1/embeddings",
       {"model": "mini", "input": [TEXT] * 3, "encoding_format": "base64", "embed_dtype": dt, "endianness": end}, 200,
       lambda o, c, code=code: c.close([b64(d["embedding"], code) for d in o["data"]], [TEXT] * 3, atol=1e-2))
      for dt, end, code in (("float32", "big", ">f4"), ("float16", "little", "<f2"), ("float16", "big", ">f2"),
                            ("bfloat16", "little", "<bf16"), ("bfloat16", "big", ">bf16"), ("float16", "native", "=f2"))],
    *[(f"vllm bad {name}", "/v1/embeddings",
       {"model": "mini", "input": TEXT, "encoding_format": "base64", name: f"bad_{name}"}, 400, refused(f"bad_{name}"))
      for name in ("encoding_format", "embed_dtype", "endianness")],
    ("vllm use_activation false", "/v1/embeddings", {"model": "mini", "input": TEXT, "use_activation": False}, 200,
     lambda o, c: abs(np.linalg.norm(vectors(o)) - 1) > 1e-2 and c.close(vectors(o), [TEXT])),
    ("vllm use_activation true", "/v1/embeddings", {"model": "mini", "input": TEXT, "use_activation": True}, 200,
     lambda o, c: abs(np.linalg.norm(vectors(o)) - 1) < 1e-4),
    ("vllm chat messages refused", "/v1/embeddings", {"model": "mini", "messages": [{"role": "user", "content": "x"}]},
     400, refused("messages")),
    ("vllm add_special_tokens false refused", "/v1/embeddings",
     {"model": "mini", "input": TEXT, "add_special_tokens": False}, 400, refused("add_special_tokens")),
    ("vllm fp8 embed_dtype refused", "/v1/embeddings",
     {"model": "mini", "input": TEXT, "encoding_format": "base64", "embed_dtype": "fp8_e4m3"}, 400, refused("embed_dtype")),
    ("oversize max_tokens refused", "/v1/embeddings", {"model": "mini", "input": TEXT, "max_tokens": 8193}, 400,
     lambda o, c: o["error"]["param"] == "max_tokens" and "256" in o["error"]["message"]),
    ("type error is 400 on OpenAI's route", "/v1/embeddings", {"model": "mini", "input": 5}, 400, refused("`input`")),
    # --- vLLM: /pooling, the embed task (pooling/pooling/protocol.py's answer: data[i].data) ---
    ("vllm pooling token ids", "/pooling", {"model": "mini", "input": ["IDS"] * 2, "task": "embed"}, 200,
     lambda o, c: [d["object"] for d in o["data"]] == ["pooling"] * 2 and o["usage"]["prompt_tokens"] == 2 * c.tokens(TEXT)
     and c.close([d["data"] for d in o["data"]], [TEXT] * 2)),
    ("vllm pooling text, default task, base64", "/pooling", {"model": "mini", "input": [TEXT, PT], "encoding_format": "base64"},
     200, lambda o, c: c.close([b64(d["data"], "<f4") for d in o["data"]], [TEXT, PT])),
    ("vllm pooling other task refused", "/pooling", {"model": "mini", "input": TEXT, "task": "token_embed"}, 400,
     lambda o, c: o["error"]["param"] == "task" and "token_embed" in message(o)),
    ("vllm invocations embeddings", "/invocations", {"model": "mini", "input": TEXT, "encoding_format": "float"}, 200,
     lambda o, c: o["object"] == "list" and c.close(vectors(o), [TEXT])),
    ("vllm tokenize prompt", "/tokenize", {"model": "mini", "prompt": TEXT}, 200,
     lambda o, c: o["tokens"] == c.ids(TEXT) and o["count"] == c.tokens(TEXT) and o["max_model_len"] == 256),
    ("vllm tokenize token strings", "/tokenize", {"prompt": "hello world", "return_token_strs": True,
                                                 "add_special_tokens": False}, 200,
     lambda o, c: o["token_strs"] == ["hello", "world"]),
    ("vllm detokenize", "/detokenize", {"model": "mini", "tokens": "TEXT_IDS"}, 200,
     lambda o, c: o["prompt"] == "[CLS] " + TEXT.lower() + " [SEP]"),
    # --- vLLM: rerank and score (scoring/test_cross_encoder_online.py, test_max_tokens_per_doc.py) ---
    ("vllm rerank", "/rerank", {"model": "ce", "query": QUERY, "documents": DOCS}, 200,
     lambda o, c: len(o["results"]) == 2 and o["usage"]["prompt_tokens"] == o["usage"]["total_tokens"] > 0
     and sorted_best_first(o["results"], "relevance_score")),
    ("vllm rerank top_n", "/rerank", {"model": "ce", "query": QUERY, "documents": [*DOCS, "Cross-encoders are neat"],
                                      "top_n": 2}, 200, lambda o, c: len(o["results"]) == 2),
    ("vllm max_tokens_per_doc", "/rerank", {"model": "ce", "query": QUERY, "documents": ["The capital of France is Paris. " * 50],
                                            "max_tokens_per_doc": 10}, 200,
     lambda o, c: 0 < o["usage"]["prompt_tokens"] <= c.tokens(QUERY) + 10 + 1),
    *[(f"vllm max_tokens_per_doc {n}", "/rerank", {"model": "ce", "query": QUERY, "documents": DOCS,
                                                   "max_tokens_per_doc": n}, 400, refused("max_tokens_per_doc"))
      for n in (0, -5)],
    ("vllm rerank use_activation false", "/rerank", {"model": "ce", "query": QUERY, "documents": DOCS,
                                                      "use_activation": False}, 200,
     lambda o, c: np.allclose(sorted(1 / (1 + np.exp(-np.array([r["relevance_score"] for r in o["results"]])))),
                              sorted(r["relevance_score"] for r in c.call("/rerank", {
                                  "model": "ce", "query": QUERY, "documents": DOCS})[1]["results"]), atol=1e-5)),
    ("vllm rerank truncate_prompt_tokens below the limit refused", "/rerank",
     {"model": "ce", "query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 5}, 400,
     refused("truncate_prompt_tokens", "max_tokens_per_doc")),
    ("vllm invocations rerank", "/invocations", {"model": "ce", "query": QUERY, "documents": DOCS}, 200,
     lambda o, c: len(o["results"]) == 2),
    *[(f"vllm score {a}/{b}", "/score", {"model": "ce", a: TEXTS_1 if n else TEXTS_1[0], b: TEXTS_2}, 200,
       lambda o, c: [d["index"] for d in o["data"]] == [0, 1] and all(d["object"] == "score" for d in o["data"])
       and o["usage"]["prompt_tokens"] > 0)
      for a, b, n in (("queries", "documents", 0), ("queries", "documents", 1), ("queries", "items", 1),
                      ("text_1", "text_2", 1), ("data_1", "data_2", 1))],
    ("vllm score N:M refused", "/score", {"model": "ce", "text_1": TEXTS_1, "text_2": [*TEXTS_2, "x"]}, 400,
     refused("text_1")),
    ("vllm score of an embedding model is the cosine", "/score", {"model": "mini", "text_1": TEXT, "text_2": [PT, TEXT]},
     200, lambda o, c: abs(o["data"][1]["score"] - 1) < 1e-4 and abs(o["data"][0]["score"] - float(
         cosine_rows(*(c.st_model.encode([t]) for t in (TEXT, PT)))[0])) < 1e-4),
    ("vllm invocations score", "/invocations", {"model": "ce", "text_1": TEXTS_1[0], "text_2": TEXTS_2}, 200,
     lambda o, c: len(o["data"]) == 2),
    # --- TEI (router/tests/test_http_embed.rs, the routes and error types of router/src/http/server.rs) ---
    ("tei mrl single (its snapshot)", "/embed", {"inputs": "test", "dimensions": 128}, 200,
     lambda o, c: len(o[0]) == 128 and np.allclose(o[0][:8], TEI_MRL_TEST, atol=TEI_ATOL)),
    ("tei mrl batch equals single", "/embed", {"inputs": ["test"] * 3, "dimensions": 128}, 200,
     lambda o, c: all(np.allclose(row, o[0], atol=1e-6) for row in o) and np.allclose(o[0][:8], TEI_MRL_TEST, atol=TEI_ATOL)),
    ("tei embed", "/embed", {"inputs": [TEXT, PT]}, 200, lambda o, c: c.close(o, [TEXT, PT])),
    ("tei empty batch", "/embed", {"inputs": []}, 400, refused("inputs")),
    ("tei type error is 422", "/embed", {"inputs": 5}, 422,
     lambda o, c: o["error_type"] == "Validation" and "inputs" in o["error"]),
    ("tei POST / embeds", "/", {"inputs": TEXT}, 200, lambda o, c: c.close(o, [TEXT])),
    ("tei POST / reranks", "/", {"model": "ce", "query": QUERY, "texts": DOCS}, 200,
     lambda o, c: sorted(r["index"] for r in o) == [0, 1] and sorted_best_first(o, "score")),
    ("tei POST / similarity", "/", {"inputs": {"source_sentence": TEXT, "sentences": [TEXT, PT]}}, 200,
     lambda o, c: abs(o[0] - 1) < 1e-4 and o[1] < 0.9),
    ("tei similarity", "/similarity", {"inputs": {"source_sentence": TEXT, "sentences": [PT]},
                                        "parameters": {"truncate": True, "truncation_direction": "right"}}, 200,
     lambda o, c: abs(o[0] - float(cosine_rows(*(c.st_model.encode([t]) for t in (TEXT, PT)))[0])) < 1e-4),
    ("tei similarity empty", "/similarity", {"inputs": {"source_sentence": TEXT, "sentences": []}}, 400,
     refused("sentences")),
    ("tei decode", "/decode", {"ids": "TEXT_IDS"}, 200, lambda o, c: o == [TEXT.lower()]),
    ("tei decode batch", "/decode", {"ids": ["TEXT_IDS", "TEXT_IDS"], "skip_special_tokens": False}, 200,
     lambda o, c: o == ["[CLS] " + TEXT.lower() + " [SEP]"] * 2),
    ("tei decode empty", "/decode", {"ids": []}, 400, refused("ids")),
    ("tei /embeddings alias", "/embeddings", {"input": [TEXT], "encoding_format": "float"}, 200,
     lambda o, c: o["object"] == "list" and c.close(vectors(o), [TEXT])),
    ("tei vertex", "/vertex", {"instances": [{"inputs": TEXT}, {"model": "ce", "query": QUERY, "texts": DOCS}]}, 200,
     lambda o, c: c.close(o["predictions"][0], [TEXT]) and len(o["predictions"][1]) == 2),
    ("tei rerank return_text", "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS, "return_text": True}, 200,
     lambda o, c: all(r["text"] == DOCS[r["index"]] for r in o)),
    ("tei tokenize", "/tokenize", {"inputs": "hello world"}, 200,
     lambda o, c: [t["text"] for t in o[0]] == ["[CLS]", "hello", "world", "[SEP]"]),
    ("tei invocations in TEI's form", "/invocations", {"inputs": [TEXT]}, 200, lambda o, c: c.close(o, [TEXT])),
    # --- Cohere's embed (the SDK's request and response shapes) ---
    ("cohere v2 embed", "/v2/embed", {"model": "mini", "texts": [TEXT], "input_type": "search_document"}, 200,
     lambda o, c: o["response_type"] == "embeddings_by_type" and c.close(o["embeddings"]["float"], [TEXT])
     and o["meta"]["billed_units"]["input_tokens"] == c.tokens(TEXT)),
    ("cohere v2 base64", "/v2/embed", {"model": "mini", "texts": [TEXT, PT], "input_type": "search_query",
                                       "embedding_types": ["base64"]}, 200,
     lambda o, c: c.close([b64(r, "<f4") for r in o["embeddings"]["base64"]], [TEXT, PT])),
    ("cohere v1 embed floats", "/v1/embed", {"model": "mini", "texts": [TEXT]}, 200,
     lambda o, c: o["response_type"] == "embeddings_floats" and c.close(o["embeddings"], [TEXT])),
    ("cohere images refused", "/v2/embed", {"model": "mini", "images": ["data:image/png;base64,AA=="],
                                            "input_type": "image"}, 400, refused("image")),
    ("cohere texts required, 400", "/v2/embed", {"model": "mini", "input_type": "search_query"}, 400, refused("texts")),
    ("cohere inputs of text parts", "/v2/embed", {"model": "mini", "input_type": "search_query",
                                                  "inputs": [{"content": [{"type": "text", "text": TEXT}]}]}, 200,
     lambda o, c: c.close(o["embeddings"]["float"], [TEXT])),
]


def resolved(value: Any, ctx: Context) -> Any:
    """A body with placeholders for token ids (IDS: TEXT's, PT_IDS: PT's, TEXT_IDS: TEXT's) filled in."""
    ids = {"IDS": TEXT, "PT_IDS": PT, "TEXT_IDS": TEXT}
    if isinstance(value, str) and value in ids:
        return ctx.ids(ids[value])
    if isinstance(value, list):
        return [resolved(v, ctx) for v in value]
    if isinstance(value, dict):
        return {k: resolved(v, ctx) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def ctx(served_gateway, st_model) -> Context:
    return Context(served_gateway.url, served_gateway.key, st_model)


@pytest.mark.parametrize("name,path,body,status,check", CASES, ids=[c[0] for c in CASES])
def test_peer_case(ctx, name, path, body, status, check):
    got, out, _ = ctx.call(path, resolved(body, ctx))
    assert got == status, (got, out)
    assert check is None or check(out, ctx), out


@pytest.mark.parametrize("path", ["/health", "/ping", "/"])
def test_tei_health_routes(ctx, path):
    assert ctx.call(path, method="GET")[0] == 200


def test_tei_info_fields(ctx):
    """TEI's /info fields with real values (a CPU server: float32, 1,024-token steps)."""
    status, info, _ = ctx.call("/info", method="GET")
    assert status == 200, info
    assert info["served_model_name"] == "embed" and info["model_dtype"] == "float32"
    assert info["max_input_length"] == 256 and info["max_batch_tokens"] == 1024
    assert info["max_client_batch_size"] == 2048 and info["auto_truncate"] is True
    assert info["tokenization_workers"] >= 1 and info["max_concurrent_requests"] > 0
    _, rerank, _ = ctx.call("/info?model=ce", method="GET")
    assert rerank["model_type"] == {"reranker": {"id2label": {"0": "score"}, "label2id": {"score": 0}}}
