"""OpenAI's Batch API on the gateway (gateway/batch), driven by the openai SDK against a real
tritonserver: embeddings and reranks answered as sentence-transformers / CrossEncoder answer,
bad lines in the error file, cancel, limits, and a gateway killed mid-job that resumes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import MIN_COSINE, TEXTS, RunningServer, cosine_rows
from pergola.gateway import state
from pergola.gateway.offload import Offload
from pergola.gateway.options import GatewayOptions
from test_gateway import KEY, Gateway, call, port_of, start_gateway
from test_rerank import DOCS, QUERY, cross_encoder_reference

MAX_LINES, MAX_FILE_BYTES = 400, 400_000  # the main gateway's limits (the 67-line file fits)
DONE = ("completed", "failed", "cancelled", "expired")


def embed_line(i: int, texts: list[str], model: str = "minilm") -> dict:
    return {"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": model, "input": texts if len(texts) > 1 else texts[0]}}


def corpus(n: int) -> list[str]:
    """`n` short, distinct texts (short: the CPU encodes them fast)."""
    topics = ["rivers", "the moon", "bread", "jazz", "glaciers", "chess", "volcanoes", "bees"]
    return [f"note {i}: a few words about {topics[i % len(topics)]} and number {i * 7 % 101}" for i in range(n)]


def jsonl(rows: list[dict | str]) -> bytes:
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)


def sdk(gw: Gateway):
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def wait_for(client, batch_id: str, until=lambda b: b.status in DONE, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.1)


def records(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def submit(client, data: bytes, endpoint: str = "/v1/embeddings"):
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h",
                                 metadata={"suite": "test_batch_api"})


@pytest.fixture(scope="module")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("batch-gateway")
    gw = start_gateway(tmp, server.grpc_url, "--api-key", KEY, "--batch-data", str(tmp / "data"),
                       "--triton-repository", str(server.repo), "--batch-max-lines", str(MAX_LINES),
                       "--batch-max-file-bytes", str(MAX_FILE_BYTES), http=port_of(server.http_url))
    yield gw
    gw.stop()


def slow_gateway(server: RunningServer, data: Path, tmp: Path) -> Gateway:
    """A gateway whose jobs run in many small sequential waves (long enough to stop mid-way)."""
    tmp.mkdir(parents=True, exist_ok=True)
    return start_gateway(tmp, server.grpc_url, "--api-key", KEY, "--batch-data", str(data),
                         "--batch-call-chars", "600", "--batch-concurrency", "1", http=port_of(server.http_url))


def test_sdk_batch_answers_as_sentence_transformers_and_cross_encoder(gateway, st_model, rerank_folders):
    n, every = 60, 10  # embedding lines (both models), every tenth of three texts
    texts = corpus(n)
    lines: list[dict | str] = []
    inputs: dict[str, list[str]] = {}
    for i in range(n):
        chosen = [texts[i]] + ([TEXTS[i % len(TEXTS)], texts[(i + 1) % n]] if i % every == 0 else [])
        lines.append(embed_line(i, chosen, "minilm" if i % 2 else "embed"))
        inputs[f"emb-{i}"] = chosen
    queries = {f"rr-{j}": f"{QUERY} ({['city', 'river'][j % 2]})" for j in range(4)}  # (a CrossEncoder load each)
    for custom_id, query in queries.items():
        lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/rerank",
                      "body": {"model": "ce", "query": query, "documents": DOCS[:5]}})
    at = n // 2  # the three bad lines are lines at + 1 .. at + 3 of the file
    lines[at:at] = ['{"custom_id": "torn", "method": "POST"',  # not JSON
                    {"custom_id": "bad-body", "method": "POST", "url": "/v1/embeddings",
                     "body": {"model": "minilm", "input": 5}},  # the route refuses it
                    {"custom_id": "bad-url", "method": "POST", "url": "/v1/chat/completions", "body": {}}]
    good = n + len(queries)
    client = sdk(gateway)
    created = submit(client, jsonl(lines))
    assert created.status == "validating" and created.metadata == {"suite": "test_batch_api"}
    batch = wait_for(client, created.id)
    assert batch.status == "completed", batch
    print(f"{len(lines)} lines answered in {batch.completed_at - batch.created_at} s")
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (good + 3, good, 3)

    out = records(client, batch.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert len(ids) == len(set(ids)) == good and set(ids) == set(inputs) | set(queries)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in out)
    by_id = {r["custom_id"]: r["response"]["body"] for r in out}
    flat = [t for cid in inputs for t in inputs[cid]]
    reference = dict(zip(flat, st_model.encode(flat, convert_to_numpy=True, batch_size=64)))
    for cid, chosen in inputs.items():
        got = np.array([d["embedding"] for d in by_id[cid]["data"]], dtype=np.float32)
        assert [d["index"] for d in by_id[cid]["data"]] == list(range(len(chosen)))
        assert cosine_rows(got, np.stack([reference[t] for t in chosen])).min() >= MIN_COSINE, cid
    tokens = sum(by_id[cid]["usage"]["total_tokens"] for cid in by_id)
    assert batch.usage.input_tokens == tokens > 0
    expected = {q: cross_encoder_reference(rerank_folders["cross-encoder"], q, DOCS[:5]) for q in set(queries.values())}
    for cid, query in queries.items():
        order = np.argsort(-expected[query], kind="stable").tolist()
        assert [r["index"] for r in by_id[cid]["results"]] == order, cid

    errors = {r["custom_id"]: r for r in records(client, batch.error_file_id)}
    assert set(errors) == {None, "bad-body", "bad-url"}
    assert errors[None]["error"]["code"] == "invalid_request" and f"line {at + 1}" in errors[None]["error"]["message"]
    assert errors["bad-url"]["error"]["message"].startswith(f"line {at + 3}")
    refused = errors["bad-body"]["response"]
    assert 400 <= refused["status_code"] < 500 and refused["body"]["error"]["param"] == "input"
    assert [e.line for e in batch.errors.data] == [at + 1, at + 3]  # validation lists the lines that are not requests
    assert batch.id in {b.id for b in client.batches.list(limit=100)}


def test_limits_keys_and_lookups(gateway):
    client = sdk(gateway)
    for data, option in ((jsonl([embed_line(i, ["x"]) for i in range(MAX_LINES + 1)]), "--batch-max-lines"),
                         (b"x" * (MAX_FILE_BYTES + 1), "--batch-max-file-bytes")):
        status, out = upload_raw(gateway, data)
        assert status == 413 and option in out["error"]["message"], out
    status, out = upload_raw(gateway, b"{}\n", purpose="fine-tune")
    assert status == 400 and out["error"]["param"] == "purpose"
    status, out = upload_raw(gateway, b"{}\n", key=None)
    assert status == 401
    assert call(gateway, "GET", "/v1/batches", key=None)[0] == 401
    assert call(gateway, "GET", "/v1/files/file-nothing")[0] == 404
    assert call(gateway, "GET", "/v1/batches/batch_nothing")[0] == 404
    status, out, _ = call(gateway, "POST", "/v1/batches", {"input_file_id": "file-nothing", "endpoint": "/v1/embeddings",
                                                           "completion_window": "24h"})
    assert status == 404 and out["error"]["param"] == "input_file_id"
    uploaded = client.files.create(file=("one.jsonl", jsonl([embed_line(0, ["hello"])])), purpose="batch")
    status, out, _ = call(gateway, "POST", "/v1/batches", {"input_file_id": uploaded.id, "endpoint": "/v1/completions",
                                                           "completion_window": "24h"})
    assert status == 400 and out["error"]["param"] == "endpoint"
    assert client.files.retrieve(uploaded.id).bytes == len(jsonl([embed_line(0, ["hello"])]))

    # a file of no request at all: the batch fails, saying why
    failed = wait_for(client, submit(client, b"not json\n[]\n").id)
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_file"
    # pages of one, newest first, each batch once
    done = wait_for(client, submit(client, client.files.content(uploaded.id).content).id)
    assert done.status == "completed" and done.request_counts.completed == 1
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [done.id] and first.has_more
    listed = [b.id for b in client.batches.list(limit=1)]  # (the SDK follows `after` page by page)
    assert len(listed) == len(set(listed)) >= 2 and listed[:2] == [done.id, failed.id]
    # a finished batch's input can go; a batch cannot be cancelled once completed
    assert call(gateway, "POST", f"/v1/batches/{done.id}/cancel")[0] == 400
    assert client.files.delete(uploaded.id).deleted
    assert call(gateway, "GET", f"/v1/files/{uploaded.id}/content")[0] == 404


def upload_raw(gw: Gateway, data: bytes, purpose: str = "batch", key: str | None = KEY) -> tuple[int, dict]:
    """POST /v1/files as a multipart form, without the SDK (whose retries and checks would hide the answer)."""
    import urllib.error
    import urllib.request

    boundary = "pergola-test-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(gw.url + "/v1/files", data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cancel_stops_the_job_and_keeps_what_it_answered(server, tmp_path):
    gw = slow_gateway(server, tmp_path / "data", tmp_path)
    try:
        client = sdk(gw)
        lines = [embed_line(i, [t]) for i, t in enumerate(corpus(2000))]
        batch = wait_for(client, submit(client, jsonl(lines)).id, until=lambda b: b.request_counts.completed > 0)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        cancelled = wait_for(client, batch.id, timeout=30)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
        answered = records(client, cancelled.output_file_id)
        assert 0 < len(answered) == cancelled.request_counts.completed < 2000
        assert len({r["custom_id"] for r in answered}) == len(answered)
        time.sleep(1.5)  # nothing more runs for it
        assert client.batches.retrieve(batch.id).request_counts.completed == cancelled.request_counts.completed
        assert call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": "still serving"})[0] == 200
    finally:
        gw.stop()


def test_a_gateway_killed_mid_job_resumes_and_answers_each_line_once(server, tmp_path, st_model):
    n = 200  # ~50 sequential waves of ~4 lines on the slow gateway: killed after ~10 of them
    texts = corpus(n)
    lines = [embed_line(i, [t]) for i, t in enumerate(texts)]
    first = slow_gateway(server, tmp_path / "data", tmp_path / "first")
    try:
        client = sdk(first)
        batch = wait_for(client, submit(client, jsonl(lines)).id, until=lambda b: b.request_counts.completed >= 40)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
    finally:
        first.stop()
    second = slow_gateway(server, tmp_path / "data", tmp_path / "second")
    try:
        client = sdk(second)
        resumed = client.batches.retrieve(batch.id)
        assert resumed.status == "in_progress" and resumed.request_counts.completed < n  # killed mid-job
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == n, done
        out = records(client, done.output_file_id)
        ids = [r["custom_id"] for r in out]
        assert len(ids) == n and set(ids) == {f"emb-{i}" for i in range(n)}
        sample = [out[k] for k in range(0, n, 13)]
        got = np.array([r["response"]["body"]["data"][0]["embedding"] for r in sample], dtype=np.float32)
        want = st_model.encode([texts[int(r["custom_id"].split("-")[1])] for r in sample], convert_to_numpy=True)
        assert cosine_rows(got, want).min() >= MIN_COSINE
    finally:
        second.stop()


def test_a_record_cut_short_by_a_crash_is_run_again(tmp_path):
    from pergola.gateway.batch import lines

    path = tmp_path / "output.jsonl"
    line = lines.Line(7, "a", "/v1/embeddings", b"{}")
    whole = lines.answer("batch_x", line, 200, b'{"usage": {"total_tokens": 3}}')
    path.write_bytes(whole + lines.answer("batch_x", lines.Line(8, "b", "/v1/embeddings", b"{}"), 200, b"{}")[:-9])
    assert lines.answered(path) == ({7}, 3)
    assert path.read_bytes() == whole  # the torn record is gone: line 8 runs again, and is written once


# --- how a wave of lines reaches the backend (no server: a stand-in backend) ---------------------

class StandInBackend:
    """Backend.embed's and embed_tokens' stand-in: each text's vector is [its length] (token ids':
    [their sum]); a text holding "bad" is over the token limit (TooLong naming its index in the
    call); the first `busy` calls are 429."""

    def __init__(self, busy: int = 0) -> None:
        from pergola.gateway.admission import Admission

        self.calls: list[int] = []
        self.busy = busy
        self.chunk_texts = self.chunk_chars = self.timeout_s = 0
        self.admission = Admission(1.0)

    async def embed_tokens(self, model, ids, opts):
        from pergola.gateway.backend import Embedded

        self.calls.append(len(ids.lengths))
        sums = np.add.reduceat(ids.flat, ids.offsets()[:-1])
        return Embedded(sums.astype(np.float32)[:, None], ids.lengths.astype(np.int64))

    async def embed(self, model, texts, opts):
        from pergola.gateway.backend import Embedded, TooLong
        from pergola.gateway.errors import GatewayError

        self.calls.append(len(texts))
        if self.busy:
            self.busy -= 1
            raise GatewayError(429, "queued tokens over the limit")
        bad = [i for i, t in enumerate(texts) if "bad" in t]
        if bad:
            raise TooLong(bad[0], 5, f"TEXT[{bad[0]}] has more than 5 tokens")
        return Embedded(np.array([[len(t)] for t in texts], dtype=np.float32), np.ones(len(texts), dtype=np.int64))


class StandInGateway:
    """The Gateway as a batch job sees it: its options, body reading (Gateway.body itself, CPU work on
    the loop), a served model of at most 64 texts a call, and `backend`."""

    body = state.Gateway.body

    def __init__(self, backend, opts: GatewayOptions | None = None) -> None:
        self.backend, self.opts = backend, opts or GatewayOptions()
        self.offload = Offload(0, 0)

    async def model(self, name, task):
        from pergola.gateway.catalog import ServedModel

        return ServedModel("embed", "embed", "embed", settings={"max_texts": 64})


def answer_bodies(tmp_path: Path, bodies: list[dict], backend: StandInBackend) -> list[tuple[int, dict, int]]:
    """One wave of /v1/embeddings lines of these bodies through the route's handler -> (status,
    body, tokens) per line."""
    import asyncio

    from pergola.gateway.batch import lines
    from pergola.gateway.batch.coalesce import Wave
    from pergola.gateway.batch.runner import Job, Runner
    from pergola.gateway.batch.store import Store

    async def run() -> list:
        runner = Runner(Store(tmp_path, tmp_path / "db.sqlite3"), StandInGateway(backend), GatewayOptions())
        runner.backend = backend  # (the runner's copy would be a copy of the stand-in; keep its record)
        job = Job(runner, "batch_test")
        batch = [lines.parse(i + 1, json.dumps({**embed_line(i, ["-"]), "body": b}).encode())
                 for i, b in enumerate(bodies)]
        wave = Wave(backend, len(batch), 1 << 20)
        return await asyncio.gather(*(job._line(wave, line) for line in batch))

    return [(status, json.loads(body), tokens) for _, status, body, tokens in asyncio.run(run())]


def answer_lines(tmp_path: Path, texts: list[str], backend: StandInBackend) -> list[tuple[int, dict]]:
    """One wave of one-text lines through the /v1/embeddings handler -> (status, body) per line."""
    bodies = [{"model": "minilm", "input": t} for t in texts]
    return [(status, body) for status, body, _ in answer_bodies(tmp_path, bodies, backend)]


def test_a_waves_lines_share_calls_of_up_to_max_texts_and_wait_out_refusals(tmp_path, monkeypatch):
    from pergola.gateway.batch import coalesce

    monkeypatch.setattr(coalesce, "FIRST_BACKOFF_S", 0.001)
    backend = StandInBackend(busy=1)
    texts = corpus(200)
    answers = answer_lines(tmp_path, texts, backend)
    # 200 one-text lines: four calls of at most the model's max_texts (64), after one refused for load
    assert sorted(backend.calls[1:]) == [8, 64, 64, 64] and backend.calls[0] in (8, 64)
    for text, (status, body) in zip(texts, answers):
        assert status == 200 and body["data"][0]["embedding"] == [len(text)]


def test_a_line_refused_in_a_shared_call_gets_its_own_error(tmp_path):
    backend = StandInBackend()
    texts = [f"fine text {i}" for i in range(10)]
    texts[6] = "a bad one"
    answers = answer_lines(tmp_path, texts, backend)
    assert backend.calls == [10] + [1] * 10  # the shared call refused: each line alone
    assert [status for status, _ in answers] == [200] * 6 + [400] + [200] * 3
    error = answers[6][1]["error"]
    assert error["param"] == "input" and error["message"].startswith("input[0] has more than 5 tokens")


def test_token_id_lines_share_a_call_and_numbers_are_checked_as_the_route_checks_them(tmp_path):
    backend = StandInBackend()
    ids = [[[1, 2, 3]], [[10], [20, 30]], [7, 8]]  # a list, two lists, one flat list
    refused = [{"input": "x", "dimensions": 2**33}, {"input": "x", "dimensions": True},
               {"input": "x", "max_tokens": 1.5}, {"input": [[1, 2**31]]}]
    answers = answer_bodies(tmp_path, [{"model": "minilm", "input": i} for i in ids] + refused, backend)
    assert backend.calls == [4]  # the three lines' four inputs in one call
    got = [[d["embedding"] for d in body["data"]] for _, body, _ in answers[:3]]
    assert got == [[[6.0]], [[10.0], [50.0]], [[15.0]]]
    assert [tokens for *_, tokens in answers] == [3, 3, 2, 0, 0, 0, 0]
    assert [body["usage"]["total_tokens"] for _, body, _ in answers[:3]] == [3, 3, 2]
    for (status, body, _), param in zip(answers[3:], ["dimensions", "dimensions", "max_tokens", "input"]):
        assert status == 400 and body["error"]["param"] == param, body


def test_a_jobs_calls_pass_the_gateways_admission_with_a_jobs_deadline(tmp_path):
    """A job's calls count as work in flight for online requests (and theirs for the job's), and
    are judged against a job call's deadline (JOB_TIMEOUTS x --request-timeout-s)."""
    from pergola.gateway.admission import MIN_TOKENS, Admission
    from pergola.gateway.batch.runner import JOB_TIMEOUTS, Runner
    from pergola.gateway.batch.store import Store
    from pergola.gateway.catalog import ServedModel
    from pergola.gateway.errors import GatewayError

    opts = GatewayOptions(request_timeout_s=1.0, queue_bound_s=1.0)
    backend = StandInBackend()
    backend.admission = Admission(opts.request_timeout_s, opts.queue_bound_s)
    runner = Runner(Store(tmp_path, tmp_path / "db.sqlite3"), StandInGateway(backend, opts), opts)
    online, job = backend.admission, runner.backend.admission
    served = ServedModel("embed", "embed", "embed", settings={"query_tokens": 64})
    rate = online.load(served).rate  # measured: one bulk request answered at 1,000 tokens/s
    now = 0.0
    rate.clock = lambda: now
    rate.begin()
    now = 2 * MIN_TOKENS / 1000
    rate.add(2 * MIN_TOKENS)
    rate.end()

    big = [4 * 2_000]  # ~2,000 tokens: 2 s at the measured rate, over 0.8 x the request timeout
    with pytest.raises(GatewayError) as refused:
        online.admit(served, big)
    assert refused.value.status == 413
    ticket = job.admit(served, big)  # within 0.8 x the job's deadline
    assert 1.0 < ticket.left_s() <= JOB_TIMEOUTS * opts.request_timeout_s
    assert online.load(served).lanes[1] == ticket.left > 0  # online requests see it ahead of them
    with pytest.raises(GatewayError) as busy:
        online.admit(served, [4 * 100])
    assert busy.value.status == 429
    ticket.close()
    online.admit(served, [4 * 100]).close()
