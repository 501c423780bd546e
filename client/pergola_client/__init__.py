"""Python client for a pergola server: Triton over tritonclient gRPC or HTTP, or the gateway's
HTTP API (OpenAI /v1/embeddings, Cohere /v1/rerank), with the same calls and answers.

    from pergola_client import PergolaClient, connect
    client = PergolaClient("localhost:8001")            # gRPC; protocol="http" for port 8000
    vectors = client.embed(["a query", "a document"])    # np.ndarray [2, dim] float32
    codes = client.embed(["a query"], encoding="int8")    # [1, dim] int8; "binary": [1, dim/8] uint8
    multi = client.embed_outputs(["a text"], model="m3")  # bge-m3: dense, sparse and ColBERT at once
    gateway = connect("http://localhost:8080")           # a URL with a scheme: the gateway (GatewayClient)
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
# encoding -> (output tensor, numpy dtype of its values); EMBEDDING_FP16 travels as UINT16 bits.
ENCODINGS = {
    "float32": ("EMBEDDING", np.float32),
    "float16": ("EMBEDDING_FP16", np.float16),
    "int8": ("EMBEDDING_INT8", np.int8),
    "binary": ("EMBEDDING_BINARY", np.uint8),  # sign bits, np.packbits per row: [n, ceil(dim / 8)]
    "ubinary": ("EMBEDDING_BINARY", np.uint8),  # the sentence-transformers / Cohere name of the same
}


class RerankResult(NamedTuple):
    scores: np.ndarray  # [n] float32, one per document, in input order
    indices: np.ndarray  # [k] int32, best document first (k = top_n, or n)


class ClassifyResult(NamedTuple):
    probs: np.ndarray  # [n, labels] float32, in input order (the logits with raw_scores)
    labels: list[str]  # the label of each column (the model's id2label)


class EmbedOutputs(NamedTuple):
    """bge-m3's outputs of one request, in input order; an output not asked for is empty."""

    dense: np.ndarray  # [n, dim] float32 ([n, 0] without "dense")
    sparse: list[dict[int, float]]  # per text: token id -> lexical weight
    colbert: list[np.ndarray]  # per text: [tokens - 1, dim] float32, every token but CLS, L2-normalised


def _ragged(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """Text i's rows values[offsets[i]:offsets[i + 1]] (offsets [n + 1]; empty: not asked)."""
    return [values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


def _protocol_module(protocol: str) -> Any:
    if protocol == "grpc":
        import tritonclient.grpc as module
    elif protocol == "http":
        import tritonclient.http as module
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return module


class PergolaClient:
    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = "embed",
                 timeout_s: float | None = None, api_key: str | None = None) -> None:
        """api_key: the server's key when `pergola serve --api-key` put inference behind it."""
        self.protocol = protocol
        self.model = model
        # Triton's restricted-API header (gRPC: metadata with Triton's prefix); pergola.triton.admin names it
        header = "pergola-api-key" if protocol == "http" else "triton-grpc-protocol-pergola-api-key"
        self._headers = {header: api_key} if api_key else None
        self._tc = _protocol_module(protocol)
        kwargs = {"network_timeout": timeout_s} if timeout_s and protocol == "http" else {}
        self._client = self._tc.InferenceServerClient(url or DEFAULT_URLS[protocol], **kwargs)
        self._timeout = timeout_s

    def _input(self, name: str, array: np.ndarray, datatype: str) -> Any:
        tensor = self._tc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _infer(self, model: str, inputs: list[Any], outputs: list[str]) -> Any:
        """With `timeout_s`, the server is told too (Triton's per-request `timeout`, µs): the
        encoder refuses work it cannot finish in time and drops it once the time has passed,
        instead of computing answers nobody waits for."""
        requested = [self._tc.InferRequestedOutput(n) for n in outputs]
        kwargs: dict[str, Any] = {"headers": self._headers} if self._headers else {}
        if self._timeout:
            kwargs["timeout"] = int(self._timeout * 1e6)
            if self.protocol == "grpc":
                kwargs["client_timeout"] = self._timeout
        return self._client.infer(model, inputs, outputs=requested, **kwargs)

    def _encoding(self, encoding: str, shape: list[int]) -> tuple[list[Any], str, type]:
        """-> (inputs: ENCODING, none for float32 so that older servers answer too; output; dtype)."""
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        output, dtype = ENCODINGS[encoding]
        value = np.array([encoding.encode()], dtype=object).reshape(shape)
        inputs = [] if encoding == "float32" else [self._input("ENCODING", value, "BYTES")]
        return inputs, output, dtype

    def _truncate(self, truncate: bool | str | None) -> list[Any]:
        """TRUNCATE_MODE for a mode (NONE | START | END), TRUNCATE for its BOOL form."""
        if truncate is None:
            return []
        if isinstance(truncate, str):
            return [self._input("TRUNCATE_MODE", np.array([truncate.encode()], dtype=object), "BYTES")]
        return [self._input("TRUNCATE", np.array([truncate], dtype=bool), "BOOL")]

    def embed(self, texts: Sequence[str], prompt: str | None = None, dimensions: int | None = None,
              normalize: bool | None = None, truncate: bool | str | None = None,
              model: str | None = None, encoding: str = "float32") -> np.ndarray:
        """Embeddings [len(texts), dim], row i for texts[i]: float32, float16, int8 (round(x * 127)
        of the normalised vector), or binary: sign bits packed 8 dims a byte, [len(texts), ceil(dim / 8)] uint8.
        truncate: NONE | START | END, or True (END) / False (NONE); None: the server's default."""
        data = np.array([t.encode("utf-8") if isinstance(t, str) else t for t in texts], dtype=object)
        inputs = [self._input("TEXT", data.reshape(-1), "BYTES")]
        if prompt is not None:
            inputs.append(self._input("PROMPT_NAME", np.array([prompt.encode()], dtype=object), "BYTES"))
        if dimensions is not None:
            inputs.append(self._input("DIMENSIONS", np.array([dimensions], dtype=np.int32), "INT32"))
        if normalize is not None:
            inputs.append(self._input("NORMALIZE", np.array([normalize], dtype=bool), "BOOL"))
        inputs += self._truncate(truncate)
        encoding_inputs, output, dtype = self._encoding(encoding, [1])
        return self._infer(model or self.model, inputs + encoding_inputs, [output]).as_numpy(output).view(dtype)

    def embed_outputs(self, texts: Sequence[str], outputs: Sequence[str] = ("dense", "sparse", "colbert"),
                      model: str | None = None) -> EmbedOutputs:
        """bge-m3's dense vectors, lexical weights and ColBERT vectors of `texts` from one forward
        pass (OUTPUTS; a model without bge-m3's heads refuses sparse and colbert)."""
        data = np.array([t.encode("utf-8") for t in texts], dtype=object)
        inputs = [self._input("TEXT", data, "BYTES"),
                  self._input("OUTPUTS", np.array([o.encode() for o in outputs], dtype=object), "BYTES")]
        names = ["EMBEDDING", "SPARSE_INDICES", "SPARSE_VALUES", "SPARSE_OFFSETS", "TOKEN_EMBEDDINGS", "TOKEN_OFFSETS"]
        r = self._infer(model or self.model, inputs, names)
        ids, weights = (_ragged(r.as_numpy(n), r.as_numpy("SPARSE_OFFSETS")) for n in ("SPARSE_INDICES",
                                                                                      "SPARSE_VALUES"))
        return EmbedOutputs(r.as_numpy("EMBEDDING"),
                            [dict(zip(i.tolist(), w.tolist())) for i, w in zip(ids, weights)],
                            _ragged(r.as_numpy("TOKEN_EMBEDDINGS"), r.as_numpy("TOKEN_OFFSETS")))

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               truncate: bool | str | None = None, model: str | None = None,
               instruction: str | None = None, raw_scores: bool = False) -> RerankResult:
        """Scores of `documents` against `query` (reranker served as `rerank` by default);
        `instruction`: a Qwen3-Reranker's task for this request; `raw_scores`: logits, not their sigmoid."""
        docs = np.array([d.encode("utf-8") for d in documents], dtype=object)
        inputs = [self._input("QUERY", np.array([query.encode("utf-8")], dtype=object), "BYTES"),
                  self._input("DOCUMENTS", docs.reshape(-1), "BYTES")]
        if top_n is not None:
            inputs.append(self._input("TOP_N", np.array([top_n], dtype=np.int32), "INT32"))
        inputs += self._truncate(truncate)
        if instruction is not None:
            inputs.append(self._input("INSTRUCTION", np.array([instruction.encode("utf-8")], dtype=object), "BYTES"))
        if raw_scores:
            inputs.append(self._input("RAW_SCORES", np.array([True]), "BOOL"))
        name = model or ("rerank" if self.model == "embed" else self.model)
        result = self._infer(name, inputs, ["SCORE", "INDICES"])
        return RerankResult(result.as_numpy("SCORE"), result.as_numpy("INDICES"))

    def classify(self, texts: Sequence[str], pairs: Sequence[str] | None = None, model: str = "classify",
                 raw_scores: bool = False, truncate: bool | str | None = None) -> ClassifyResult:
        """Label probabilities of `texts` (pairs: each text's second sequence) from a classifier
        (served as `classify` by default); `raw_scores`: the logits."""
        inputs = [self._input("TEXT", np.array([t.encode("utf-8") for t in texts], dtype=object), "BYTES")]
        if pairs is not None:
            inputs.append(self._input("TEXT_PAIR", np.array([p.encode("utf-8") for p in pairs], dtype=object),
                                      "BYTES"))
        if raw_scores:
            inputs.append(self._input("RAW_SCORES", np.array([True]), "BOOL"))
        inputs += self._truncate(truncate)
        result = self._infer(model, inputs, ["PROBS", "LABELS"])
        return ClassifyResult(result.as_numpy("PROBS"), [s.decode("utf-8") for s in result.as_numpy("LABELS")])

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], model: str | None = None,
                     dimensions: int | None = None, encoding: str = "float32") -> np.ndarray:
        """Pre-tokenized input straight to an encoder model (`NAME_encoder`); `encoding` as in embed."""
        lengths = np.array([[len(t) for t in token_ids]], dtype=np.int32)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids])[None, :]
        inputs = [self._input("INPUT_IDS", ids, "INT64"), self._input("LENGTHS", lengths, "INT32")]
        if dimensions is not None:
            inputs.append(self._input("DIMENSIONS", np.array([[dimensions]], dtype=np.int32), "INT32"))
        encoding_inputs, output, dtype = self._encoding(encoding, [1, 1])
        result = self._infer(model or f"{self.model}_encoder", inputs + encoding_inputs, [output])
        return result.as_numpy(output).view(dtype)

    def is_ready(self) -> bool:
        return bool(self._client.is_server_ready())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PergolaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# encoding -> the gateway's embedding_type (Cohere's names) and the dtype of its base64 bytes
GATEWAY_TYPES = {"float32": ("float", "<f4"), "float16": ("float16", "<f2"), "int8": ("int8", "i1"),
                 "binary": ("ubinary", "u1"), "ubinary": ("ubinary", "u1")}


class GatewayError(Exception):
    """An error answer of the gateway: its HTTP status and the message saying what to change."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class GatewayClient:
    """PergolaClient's calls through the gateway (`pergola serve` port 8080, or `pergola gateway`):
    embeddings from OpenAI's /v1/embeddings (base64, pergola's extras), rerank from Cohere's
    /v1/rerank. The answers are PergolaClient's: arrays in input order, RerankResult."""

    def __init__(self, url: str = "http://localhost:8080", model: str = "embed", timeout_s: float | None = None,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s or 300.0
        self._headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"}
                                                                 if api_key else {})

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                text = answer.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                error = json.loads(raw)
                message = error.get("message") or error.get("error", {}).get("message") or str(error)
            except ValueError:
                message = raw.decode(errors="replace")
            raise GatewayError(e.code, message) from None
        return json.loads(text) if text else None

    def embed(self, texts: Sequence[str], prompt: str | None = None, dimensions: int | None = None,
              normalize: bool | None = None, truncate: bool | str | None = None,
              model: str | None = None, encoding: str = "float32") -> np.ndarray:
        """As PergolaClient.embed; `truncate` also takes a mode, NONE | START | END."""
        if encoding not in GATEWAY_TYPES:
            raise ValueError(f"encoding must be one of {', '.join(GATEWAY_TYPES)}, got {encoding!r}")
        embedding_type, dtype = GATEWAY_TYPES[encoding]
        body: dict[str, Any] = {"model": model or self.model, "input": list(texts), "encoding_format": "base64",
                                "embedding_type": embedding_type}
        for name, value in (("prompt_name", prompt), ("dimensions", dimensions), ("normalize", normalize),
                            ("truncate", truncate)):
            if value is not None:
                body[name] = value
        out = self._call("POST", "/v1/embeddings", body)
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in out["data"]])

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               truncate: bool | str | None = None, model: str | None = None,
               instruction: str | None = None) -> RerankResult:
        """As PergolaClient.rerank; `instruction`: a Qwen3-Reranker's task for this request."""
        body: dict[str, Any] = {"model": model or ("rerank" if self.model == "embed" else self.model),
                                "query": query, "documents": list(documents)}
        for name, value in (("truncate", truncate), ("instruction", instruction)):
            if value is not None:
                body[name] = value
        results = self._call("POST", "/v1/rerank", body)["results"]  # every document, best first
        scores = np.zeros(len(documents), dtype=np.float32)
        for r in results:
            scores[r["index"]] = r["relevance_score"]
        indices = np.array([r["index"] for r in results], dtype=np.int32)
        return RerankResult(scores, indices[:top_n] if top_n else indices)

    def is_ready(self) -> bool:
        try:
            self._call("GET", "/health")
            return True
        except (GatewayError, OSError):
            return False

    def close(self) -> None:
        pass

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(url: str | None = None, protocol: str | None = None, **kwargs: Any) -> PergolaClient | GatewayClient:
    """A client for `url`: the gateway when it has a scheme (http://host:8080) or protocol is
    "gateway", else Triton over `protocol` (grpc by default, or http)."""
    if protocol == "gateway" or (url or "").startswith(("http://", "https://")):
        return GatewayClient(url or "http://localhost:8080", **kwargs)
    return PergolaClient(url, protocol=protocol or "grpc", **kwargs)
