"""The gateway under hostile and heavy requests: integers checked as numbers (no wrap, no 500),
echoed client strings cut, /tokenize's answer bounded, and bulk CPU work (large bodies, large
answers, /tokenize) kept off the event loop in worker processes (gateway/offload.py)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request

import numpy as np
import orjson
import pytest
from conftest import TEXTS
from test_gateway import KEY, call, ensemble_gateway, port_of, start_gateway  # noqa: F401 (a fixture)

WRAPPED = 2**32 + 128  # an INT32 tensor holds it as 128
HUGE = [2**63, 2**64 - 1, 2**64 + 1]  # numpy's OverflowError; orjson's largest int; orjson's float
NOT_INTS = [1.5, 3.0, True, "5", [5]]
# (route, body without the field, its integer fields, how its errors name them)
INT_ROUTES = [
    ("/v1/embeddings", {"model": "minilm", "input": "x"}, ["dimensions", "max_tokens"], "openai"),
    ("/embed", {"model": "minilm", "inputs": "x"}, ["dimensions"], "tei"),
    ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d"]}, ["top_n", "max_tokens_per_doc"], "cohere"),
    ("/rerank", {"model": "ce", "query": "q", "documents": ["d"]}, ["top_n", "max_tokens_per_doc"], "cohere"),
]


def message_of(family: str, out: dict) -> str:
    return {"openai": lambda o: o["error"]["message"], "cohere": lambda o: o["message"],
            "tei": lambda o: o["error"]}[family](out)


# --- units: no server ------------------------------------------------------------------------
def test_token_ids_are_flat_arrays_and_anything_else_is_named():
    from pergola.gateway.errors import GatewayError
    from pergola.gateway.offload import token_ids

    ids = token_ids([[1, 2, 3], [4]], "input")
    assert ids.flat.tolist() == [1, 2, 3, 4] and ids.lengths.tolist() == [3, 1]
    assert ids.offsets().tolist() == [0, 3, 4]
    assert token_ids([7, 8], "input").lengths.tolist() == [2]
    assert token_ids(["a", "b"], "input") is None and token_ids([["a"], ["b", "c"]], "inputs") is None
    for bad in ([[1, 2**31]], [[-1]], [[2**63]], [[2**64 - 1]], [[1.0]], [[True]], [[1, "a"]], [[]], [[1], []],
                [2**32 + 5], [1, 2.5]):
        with pytest.raises(GatewayError) as e:
            token_ids(bad, "input")
        assert e.value.status == 400 and e.value.param == "input" and "`input`" in e.value.message, bad


def test_integer_fields_are_numbers_in_range():
    from pergola.gateway.errors import GatewayError
    from pergola.gateway.http import Body

    body = Body(orjson.loads(b'{"ok": 5, "wrapped": 4294967424, "zero": 0, "negative": -3, "huge": '
                             b'18446744073709551615, "huger": 18446744073709551617, "half": 1.5, "whole": 3.0, '
                             b'"yes": true, "text": "5"}'))
    assert body.count("ok") == 5 and body.count("missing") is None
    for name in ("wrapped", "zero", "negative", "huge", "huger", "half", "whole", "yes", "text"):
        with pytest.raises(GatewayError) as e:
            body.count(name)
        assert e.value.status == 400 and e.value.param == name and f"`{name}`" in e.value.message


def test_error_messages_are_cut():
    from pergola.gateway.errors import GatewayError
    from pergola.gateway.http import error_response
    from pergola.text.errors import MESSAGE_CHARS

    response = error_response(GatewayError(404, "model " + "m" * 1_000_000 + " is not served"), "openai")
    assert response.status_code == 404 and len(response.body) < MESSAGE_CHARS + 200


def test_tokens_json_renders_in_parts_as_whole():
    """/tokenize's answer, rendered a part at a time, equals the answer built whole."""
    from pergola.gateway import tei_api

    ids = np.arange(7, dtype=np.int64)
    lengths = np.array([3, 4], dtype=np.int32)
    pieces = ["[CLS]", "a", "b", "[CLS]", "c", b"d\xc3\xa9", "e"]
    offsets = np.array([[-1, -1], [0, 1], [2, 3], [-1, -1], [0, 1], [2, 4], [5, 6]], dtype=np.int32)
    whole = orjson.loads(tei_api.tokens_json(ids, lengths, pieces, offsets))
    expected = [[{"id": int(i), "text": p if isinstance(p, str) else p.decode(), "special": bool(a < 0),
                  "start": None if a < 0 else int(a), "stop": None if a < 0 else int(b)}
                 for i, p, (a, b) in zip(ids[s:e], pieces[s:e], offsets[s:e])] for s, e in ((0, 3), (3, 7))]
    assert whole == expected
    old, tei_api.TOKENS_PER_PART = tei_api.TOKENS_PER_PART, 2
    try:
        assert orjson.loads(tei_api.tokens_json(ids, lengths, pieces, offsets)) == expected
    finally:
        tei_api.TOKENS_PER_PART = old


def test_cpu_workers_parse_refuse_bound_and_survive_a_death():
    """Token ids come back from a worker as arrays; a refusal there is the request's 400; more
    jobs than workers + queue get 429; a worker that dies costs its job a 503, not the next one."""
    from pergola.gateway.errors import GatewayError
    from pergola.gateway.offload import Offload, TokenIds, parse_body

    offload = Offload(workers=1, queue=0)

    async def main() -> None:
        data = await offload.run(parse_body, orjson.dumps({"input": [[1, 2], [3]], "model": "m"}), "input")
        assert isinstance(data["input"], TokenIds) and data["input"].flat.tolist() == [1, 2, 3]
        with pytest.raises(GatewayError) as e:
            await offload.run(parse_body, orjson.dumps({"input": [[2**63]]}), "input")
        assert e.value.status == 400 and e.value.param == "input"
        with pytest.raises(GatewayError) as e:
            await offload.run(parse_body, b"{not json", None)
        assert e.value.status == 400
        sleeping = asyncio.ensure_future(offload.run(time.sleep, 1.0))
        await asyncio.sleep(0.05)
        with pytest.raises(GatewayError) as e:
            await offload.run(time.sleep, 0)
        assert e.value.status == 429 and "--gateway-cpu-queue" in e.value.message
        await sleeping
        with pytest.raises(GatewayError) as e:
            await offload.run(os._exit, 1)
        assert e.value.status == 503
        assert await offload.run(abs, -3) == 3

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        offload.close()


# --- against the test server -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory: pytest.TempPathFactory):
    """A gateway that reads the repository (/tokenize in its CPU workers) with a small /tokenize limit."""
    gw = start_gateway(tmp_path_factory.mktemp("limits"), server.grpc_url, "--api-key", KEY,
                       "--triton-repository", str(server.repo), "--max-tokenize-chars", "50000",
                       http=port_of(server.http_url))
    yield gw
    gw.stop()


@pytest.mark.parametrize("path,body,fields,family", INT_ROUTES)
def test_integers_that_would_wrap_or_overflow_are_400_naming_the_field(gateway, path, body, fields, family):
    for field in fields:
        for value in [WRAPPED, *HUGE, 0, -1, *NOT_INTS]:
            status, out, _ = call(gateway, "POST", path, body | {field: value})
            assert status == 400, (field, value, status, out)
            assert f"`{field}`" in message_of(family, out), (field, value, out)
    assert call(gateway, "POST", path, body | {fields[0]: 2})[0] == 200  # (dimensions 2, top_n 2: fine)


def test_token_ids_that_would_wrap_or_overflow_are_400(gateway):
    for ids in ([[2**32 + 101]], [[2**63]], [[2**64 + 1]], [[-1]], [[101, True]], [[101.0]]):
        status, out, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": ids})
        assert status == 400 and out["error"]["param"] == "input", (ids, status, out)
    big = [[101] + [2**63] * 20_000]  # parsed in a CPU worker (over PARSE_BYTES)
    status, out, _ = call(gateway, "POST", "/v1/embeddings", {"model": "minilm", "input": big})
    assert status == 400 and out["error"]["param"] == "input", (status, out)


def test_a_long_model_name_is_not_echoed_whole(gateway):
    name = "m" * 1_000_000
    for path, family in (("/v1/embeddings", "openai"), ("/embed", "tei"), ("/v1/rerank", "cohere")):
        status, out, _ = call(gateway, "POST", path, {"model": name, "input": "x", "inputs": "x", "query": "q",
                                                      "documents": ["d"]})
        assert status == 404 and 0 < len(message_of(family, out)) < 2_000, (path, status)
        assert "1,000,000 characters" in message_of(family, out)


def test_tokenize_over_its_limit_is_413_naming_the_option(gateway):
    status, out, _ = call(gateway, "POST", "/tokenize", {"model": "minilm", "inputs": ["word " * 3_000] * 4})
    assert status == 413 and "--max-tokenize-chars" in out["error"], (status, out)


def test_tokenize_in_the_workers_equals_tritons_tokenizer(gateway, ensemble_gateway):
    """The CPU workers' /tokenize (tokenizer files read from the repository) answers what
    Triton's tokenizer instances do."""
    texts = TEXTS[:4] + ["123 456 " * 2_400]
    body = {"model": "minilm", "inputs": texts}
    here, there = call(gateway, "POST", "/tokenize", body), call(ensemble_gateway, "POST", "/tokenize", body)
    assert here[0] == there[0] == 200
    assert here[1] == there[1]


def _post(url: str, raw: bytes) -> int:
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json",
                                                                        "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def test_large_bodies_and_answers_do_not_stall_small_requests(gateway):
    """While 3 clients send 6 MB token-id bodies (parsed, then refused for their count) and a
    maximal /tokenize (rendered), /metrics keeps answering: on the event loop each body held
    every other request ~0.5 s here, so /metrics waited seconds."""
    big = orjson.dumps({"model": "minilm", "input": [[101] * 10 + [2000] * 9_990] * 100})  # 1M ids
    tokenize = json.dumps({"model": "minilm", "inputs": ["1 2 3 4 " * 2_000] * 3}).encode()  # ~24,000 tokens
    stop = threading.Event()
    statuses: list[int] = []

    def flood(raw: bytes, path: str) -> None:
        while not stop.is_set():
            statuses.append(_post(gateway.url + path, raw))

    threads = [threading.Thread(target=flood, args=(big, "/v1/embeddings")) for _ in range(3)]
    threads.append(threading.Thread(target=flood, args=(tokenize, "/tokenize")))
    for t in threads:
        t.start()
    waits = []
    try:
        time.sleep(1.0)
        deadline = time.monotonic() + 3  # several bodies and /tokenize answers: each held the loop ~0.5 s
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            with urllib.request.urlopen(gateway.url + "/metrics", timeout=60) as r:
                r.read()
            waits.append(time.perf_counter() - t0)
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert len(statuses) >= 4 and set(statuses) <= {200, 413}, statuses  # (413: over the test server's 64 texts)
    assert max(waits) < 1.0, f"/metrics took up to {max(waits):.2f} s (p50 {np.median(waits):.3f})"
