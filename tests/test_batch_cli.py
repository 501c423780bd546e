"""`pergola batch`: a 1,000-row Parquet corpus through the gateway, killed mid-way and resumed
(every id once, vectors as sentence-transformers'); retries and formats against a stand-in server."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import MIN_COSINE, RunningServer, cosine_rows
from test_gateway import KEY, port_of, start_gateway


def pergola_batch(*args: str) -> list[str]:
    return [sys.executable, "-m", "pergola.cli", "batch", *args]


@pytest.fixture(scope="module")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("batch-cli-gateway")
    gw = start_gateway(tmp, server.grpc_url, "--api-key", KEY, "--triton-repository", str(server.repo),
                       http=port_of(server.http_url))
    yield gw
    gw.stop()


def test_parquet_corpus_is_written_once_and_resumes_after_a_kill(gateway, tmp_path, st_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, flush = 1_000, 100  # ten parts: the kill after the second leaves most of the corpus to the resumed run
    texts = [f"t{i} {'ab'[i % 2]}" for i in range(n)]  # short: 2 CPU cores encode them in seconds
    source, out = tmp_path / "corpus.parquet", tmp_path / "vectors.parquet"
    pq.write_table(pa.table({"body": texts, "doc_id": [f"d{i}" for i in range(n)]}), source)
    command = pergola_batch(str(source), "--output", str(out), "--url", gateway.url, "--model", "minilm",
                            "--text-column", "body", "--id-column", "doc_id", "--flush-rows", str(flush),
                            "--api-key", KEY)
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts = out.with_name(out.name + ".parts")
    deadline = time.monotonic() + 300
    while len(list(parts.glob("part-*.parquet"))) < 2:
        assert first.poll() is None, first.stderr.read().decode()
        assert time.monotonic() < deadline, "no part written in time"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # the harshest interruption: nothing flushed on the way out
    first.wait(timeout=10)
    assert not out.exists()

    second = subprocess.run(command, capture_output=True, timeout=600)
    log = second.stderr.decode()
    assert second.returncode == 0, log
    already = int(log.split(" of ")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert 2 * flush <= already < n  # the parts of the first run were kept, not redone
    assert "/s" in log and "100%" in log  # the progress bar, with its rate
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == n and set(ids) == {f"d{i}" for i in range(n)}
    assert not parts.exists()
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False))
    sample = list(range(0, n, 53))
    rows = [ids.index(f"d{i}") for i in sample]
    want = st_model.encode([texts[i] for i in sample], convert_to_numpy=True)
    assert cosine_rows(vectors[rows], want).min() >= MIN_COSINE


class StandIn(BaseHTTPRequestHandler):
    """/v1/embeddings answering [len(text), number in it] as base64 vectors; the first `busy`
    requests are 429 (Retry-After), a request holding "bad" is 400; any other path echoes."""

    busy = 3
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            busy = StandIn.busy > 0
            StandIn.busy -= busy
        if busy:
            status, out = 429, {"error": {"message": "busy"}}
        elif self.path != "/v1/embeddings":
            status, out = (400, {"message": "bad"}) if body.get("query") == "bad" else (200, {"echo": body})
        elif any("bad" in t for t in body["input"]):
            status, out = 400, {"error": {"message": "bad text", "param": "input"}}
        else:
            rows = [np.array([len(t), float(t.split()[-1])], dtype="<f4") for t in body["input"]]
            status, out = 200, {"data": [{"index": i, "embedding": base64.b64encode(r.tobytes()).decode()}
                                         for i, r in enumerate(rows)]}
        with self.lock:
            StandIn.seen.append((self.path, status))
        data = json.dumps(out).encode()
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", "0.05")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def stand_in():
    StandIn.busy, StandIn.seen = 3, []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_text_lines_retry_429_and_set_refused_texts_aside(stand_in, tmp_path):
    source, out = tmp_path / "texts.txt", tmp_path / "vectors.jsonl"
    texts = [f"text number {i}" if i != 17 else "a bad 17" for i in range(1, 41)]
    source.write_text("\n".join(texts) + "\n")
    result = subprocess.run(pergola_batch(str(source), "--output", str(out), "--url", stand_in, "--batch-size", "8",
                                          "--concurrency", "2"), capture_output=True, timeout=120)
    assert result.returncode == 1 and b"1 refused" in result.stderr, result.stderr.decode()
    assert sum(status == 429 for _, status in StandIn.seen) == 3  # retried after Retry-After, not failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [i for i in range(1, 41) if i != 17]  # ids: line numbers
    for r in rows:
        text = texts[r["id"] - 1]
        assert r["embedding"] == [len(text), float(text.split()[-1])]
    [refused] = [json.loads(line) for line in (tmp_path / "vectors.jsonl.errors.jsonl").read_text().splitlines()]
    assert refused["id"] == 17 and refused["status"] == 400

    # a second run sends only the line still missing
    StandIn.seen.clear()
    again = subprocess.run(pergola_batch(str(source), "--output", str(out), "--url", stand_in), capture_output=True,
                           timeout=120)
    assert b"39 of 40 already" in again.stderr and [s for _, s in StandIn.seen] == [400]


def test_batch_api_lines_are_answered_as_records(stand_in, tmp_path):
    source, out = tmp_path / "requests.jsonl", tmp_path / "answers.jsonl"
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/rerank",
              "body": {"query": "bad" if i == 3 else f"q{i}", "documents": ["a"]}} for i in range(6)]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run(pergola_batch(str(source), "--output", str(out), "--url", stand_in), capture_output=True,
                   timeout=120)
    answers = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(answers) == ["q0", "q1", "q2", "q4", "q5"]
    assert answers["q4"]["response"] == {"status_code": 200, "request_id": None, "body": {"echo": lines[4]["body"]}}
    [refused] = map(json.loads, (tmp_path / "answers.jsonl.errors.jsonl").read_text().splitlines())
    assert refused["custom_id"] == "q3" and refused["response"]["status_code"] == 400
