"""Python client for a pergola Triton server, over tritonclient gRPC or HTTP.

    from pergola_client import PergolaClient
    client = PergolaClient("localhost:8001")            # gRPC; protocol="http" for port 8000
    vectors = client.embed(["a query", "a document"])    # np.ndarray [2, dim] float32
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


class RerankResult(NamedTuple):
    scores: np.ndarray  # [n] float32, one per document, in input order
    indices: np.ndarray  # [k] int32, best document first (k = top_n, or n)


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
                 timeout_s: float | None = None) -> None:
        self.protocol = protocol
        self.model = model
        self._tc = _protocol_module(protocol)
        self._client = self._tc.InferenceServerClient(url or DEFAULT_URLS[protocol])
        self._timeout = timeout_s

    def _input(self, name: str, array: np.ndarray, datatype: str) -> Any:
        tensor = self._tc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _infer(self, model: str, inputs: list[Any], outputs: list[str]) -> Any:
        requested = [self._tc.InferRequestedOutput(n) for n in outputs]
        kwargs = {"client_timeout": self._timeout} if self._timeout and self.protocol == "grpc" else {}
        return self._client.infer(model, inputs, outputs=requested, **kwargs)

    def embed(self, texts: Sequence[str], prompt: str | None = None, dimensions: int | None = None,
              normalize: bool | None = None, truncate: bool | None = None,
              model: str | None = None) -> np.ndarray:
        """Embeddings [len(texts), dim] float32, row i for texts[i]."""
        data = np.array([t.encode("utf-8") if isinstance(t, str) else t for t in texts], dtype=object)
        inputs = [self._input("TEXT", data.reshape(-1), "BYTES")]
        if prompt is not None:
            inputs.append(self._input("PROMPT_NAME", np.array([prompt.encode()], dtype=object), "BYTES"))
        if dimensions is not None:
            inputs.append(self._input("DIMENSIONS", np.array([dimensions], dtype=np.int32), "INT32"))
        if normalize is not None:
            inputs.append(self._input("NORMALIZE", np.array([normalize], dtype=bool), "BOOL"))
        if truncate is not None:
            inputs.append(self._input("TRUNCATE", np.array([truncate], dtype=bool), "BOOL"))
        return self._infer(model or self.model, inputs, ["EMBEDDING"]).as_numpy("EMBEDDING")

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               truncate: bool | None = None, model: str | None = None) -> RerankResult:
        """Scores of `documents` against `query` (reranker served as `rerank` by default)."""
        docs = np.array([d.encode("utf-8") for d in documents], dtype=object)
        inputs = [self._input("QUERY", np.array([query.encode("utf-8")], dtype=object), "BYTES"),
                  self._input("DOCUMENTS", docs.reshape(-1), "BYTES")]
        if top_n is not None:
            inputs.append(self._input("TOP_N", np.array([top_n], dtype=np.int32), "INT32"))
        if truncate is not None:
            inputs.append(self._input("TRUNCATE", np.array([truncate], dtype=bool), "BOOL"))
        name = model or ("rerank" if self.model == "embed" else self.model)
        result = self._infer(name, inputs, ["SCORE", "INDICES"])
        return RerankResult(result.as_numpy("SCORE"), result.as_numpy("INDICES"))

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], model: str | None = None,
                     dimensions: int | None = None) -> np.ndarray:
        """Pre-tokenized input straight to an encoder model (`NAME_encoder`)."""
        lengths = np.array([[len(t) for t in token_ids]], dtype=np.int32)
        ids = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids])[None, :]
        inputs = [self._input("INPUT_IDS", ids, "INT64"), self._input("LENGTHS", lengths, "INT32")]
        if dimensions is not None:
            inputs.append(self._input("DIMENSIONS", np.array([[dimensions]], dtype=np.int32), "INT32"))
        return self._infer(model or f"{self.model}_encoder", inputs, ["EMBEDDING"]).as_numpy("EMBEDDING")

    def is_ready(self) -> bool:
        return bool(self._client.is_server_ready())

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "PergolaClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
