"""The real tritonserver, over gRPC and HTTP, against sentence-transformers on the same weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from conftest import BF16_ATOL, MIN_COSINE, TEST_DEVICE, TEXTS, cosine_rows

# FP32 on the CPU must agree to 1e-4 cosine; a BF16 GPU instance to 1e-3.
MAX_DIFF = 1e-5 if TEST_DEVICE == "cpu" else BF16_ATOL


def test_embed_matches_sentence_transformers(client, reference):
    out = client.embed(TEXTS)
    assert out.shape == reference.shape and out.dtype == np.float32
    assert cosine_rows(out, reference).min() >= MIN_COSINE


def test_single_text(client, reference):
    out = client.embed([TEXTS[0]])
    assert out.shape == (1, reference.shape[1])
    assert cosine_rows(out, reference[:1]).min() >= MIN_COSINE


def test_batched_equals_single(client):
    batched = client.embed(TEXTS)
    singles = np.concatenate([client.embed([t]) for t in TEXTS])
    assert np.abs(batched - singles).max() <= MAX_DIFF


def test_concurrent_requests_do_not_change_results(server, client):
    """Requests sent together share encoder steps; each text's embedding must not move."""
    from pergola_client import PergolaClient

    expected = {t: client.embed([t])[0] for t in TEXTS}
    jobs = [TEXTS[i:i + k] for k in (1, 2, 3) for i in range(0, len(TEXTS), k)] * 2
    url = server.grpc_url if client.protocol == "grpc" else server.http_url

    def call(texts: list[str]) -> np.ndarray:  # one client per call: the HTTP client is not thread-safe
        with PergolaClient(url, protocol=client.protocol) as c:
            return c.embed(texts)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, jobs))
    for texts, out in zip(jobs, results):
        for t, row in zip(texts, out):
            assert np.abs(row - expected[t]).max() <= MAX_DIFF


def test_dimensions_and_normalize_options(client):
    full = client.embed(TEXTS[:4], normalize=False)
    assert not np.allclose(np.linalg.norm(full, axis=1), 1.0)
    short = client.embed(TEXTS[:4], dimensions=64)
    assert short.shape == (4, 64)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)


def test_long_text_is_truncated_by_default(client, reference):
    long_text = TEXTS[1] * 5  # far over 256 tokens
    out = client.embed([long_text])
    assert out.shape == (1, 384) and np.isfinite(out).all()


def test_token_count_output(server, st_model):
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    text = grpcclient.InferInput("TEXT", [3], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:3]], dtype=object))
    result = c.infer("embed", [text], outputs=[grpcclient.InferRequestedOutput("TOKEN_COUNT")])
    expected = [min(len(st_model.tokenizer(t)["input_ids"]), 256) for t in TEXTS[:3]]
    assert result.as_numpy("TOKEN_COUNT").tolist() == expected


def test_named_model_and_default_alias_agree(server):
    from pergola_client import PergolaClient

    with PergolaClient(server.grpc_url) as c:
        # Same model: equal up to the order of float additions (GPU pooling sums with atomics).
        np.testing.assert_allclose(c.embed(TEXTS[:3], model="minilm"), c.embed(TEXTS[:3], model="embed"),
                                   atol=1e-6, rtol=0)


def test_pretokenized_encoder_reads_known_values(server, st_model, reference):
    """Known token ids sent straight to the encoder come back as the reference embeddings.

    This is the guard against a stub that reads tensors wrongly (numpy 2 under the stub)."""
    from pergola_client import PergolaClient

    ids = [st_model.tokenizer(t, truncation=True, max_length=256)["input_ids"] for t in TEXTS]
    with PergolaClient(server.grpc_url) as c:
        out = c.embed_tokens(ids, model="minilm_encoder")
    assert cosine_rows(out, reference).min() >= MIN_COSINE


def test_server_metrics_endpoint(server, client):
    import re
    import time
    import urllib.request

    client.embed(TEXTS[:3])
    deadline = time.monotonic() + 5  # (pergola's counters reach Triton within a second or two)
    while True:
        body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        tokens = re.search(r'pergola_tokens_total\{model="minilm_encoder"\} (\d+)', body)
        if tokens and int(tokens.group(1)) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 'nv_inference_request_success{model="minilm_encoder"' in body
    assert tokens and int(tokens.group(1)) > 0
    assert re.search(r'pergola_steps_total\{mode="(eager|replay|warmup|capture)",model="minilm_encoder"\} [1-9]', body) \
        or re.search(r'pergola_steps_total\{model="minilm_encoder",mode="\w+"\} [1-9]', body)
    assert 'pergola_attention_backend{' in body


def test_server_metrics_catch_up_after_a_burst(server, client):
    """Counters are sent at most once a second; what a burst leaves behind arrives once the
    encode loop has been idle for a second, without another request (pergola.triton.metrics)."""
    import re
    import time
    import urllib.request

    def requests_total() -> int:
        body = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        found = re.search(r'pergola_requests_total\{model="minilm_encoder"\} (\d+)', body)
        return int(found.group(1)) if found else 0

    time.sleep(1.5)  # earlier tests' counts are all in
    before = requests_total()
    for text in TEXTS[:5]:  # five requests inside one flush interval
        client.embed([text])
    deadline = time.monotonic() + 5
    while requests_total() != before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests_total() == before + 5


def test_wait_ready_waits_for_the_metrics_port_too():
    """Triton starts its metrics service after the HTTP one; a caller that scrapes right after
    readiness must not be refused (a CI run of test_overload once was)."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pergola.triton.server import free_port, wait_ready

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    health = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    metrics_port, metrics = free_port(), []

    def metrics_later() -> None:
        time.sleep(1.0)
        metrics.append(ThreadingHTTPServer(("127.0.0.1", metrics_port), Ok))
        metrics[0].serve_forever()

    threading.Thread(target=metrics_later, daemon=True).start()
    try:
        wait_ready(health.server_address[1], None, timeout=10, metrics_port=metrics_port)
        assert metrics, "wait_ready returned before the metrics port was up"
    finally:
        health.shutdown()
        if metrics:
            metrics[0].shutdown()


def test_free_ports_are_distinct_and_free():
    """The ports a server is started on are picked together: one at a time, a port just released can
    come back at once (tritonserver once got the same port for HTTP and gRPC and refused to start)."""
    import socket

    from pergola.triton.server import free_ports, local_ports

    ports = free_ports(256)  # picked one at a time, 64 held a repeat in 22 of 200 tries on a CI-sized host
    assert len(set(ports)) == 256
    for port in ports[:8]:  # released: each can be bound again
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert len(set(local_ports().values())) == 3
