"""One `pergola serve --model mini=ORG/NAME` from an offline Hugging Face cache (HF_HUB_OFFLINE=1):
it answers, /info names the Hub id and commit, and the documented metrics (README: Metrics)
appear on Triton's port and the gateway's /metrics and move by what the requests did."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from test_hub import MAIN, REPO_ID, add_snapshot

pytestmark = pytest.mark.server
TEXTS = ["offline hosts serve from the cache", "a second text, a little longer than the first one"]
REQUESTS = 3
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """(name, labels) -> value from Prometheus' text format."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(LABEL.findall(match["labels"] or ""))
            out[(match["name"], labels)] = float(match["value"])
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum over the series of `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def post(url: str, body: object) -> tuple[object, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.load(r), dict(r.headers)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path):
    from conftest import start_serve

    root = tmp_path_factory.mktemp("hub-serve")
    add_snapshot(root / "hf-cache", REPO_ID, minilm_folder, MAIN)
    with pytest.MonkeyPatch.context() as env:  # what the server process inherits
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_HUB_CACHE", str(root / "hf-cache"))
        process = start_serve(root, f"mini={REPO_ID}", "--metrics-flush-s", "0")
    try:
        base = process.wait_gateway()
        yield process, base, f"http://127.0.0.1:{process.metrics}/metrics"
    finally:
        process.stop()


def test_a_hub_id_is_served_from_the_offline_cache(served, st_model):
    _, base, _ = served
    vectors, _ = post(f"{base}/embed", {"inputs": TEXTS, "model": "mini"})
    expected = st_model.encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(np.array(vectors, dtype=np.float32), expected, atol=2e-3)
    with urllib.request.urlopen(f"{base}/info?model=mini", timeout=30) as r:
        info = json.load(r)
    assert (info["hub_id"], info["model_sha"], info["model_id"]) == (REPO_ID, MAIN, "mini")


def test_metrics_have_their_names_and_move_by_what_the_requests_did(served):
    process, base, triton_url = served
    before, gateway_before = scrape(triton_url), scrape(f"{base}/metrics")
    tokens = 0
    for _ in range(REQUESTS):
        _, headers = post(f"{base}/embed", {"inputs": TEXTS, "model": "mini"})
        tokens += int(headers["x-total-tokens"])
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"{base}/no-such-route", timeout=30)

    def moved(samples: dict, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    deadline = time.monotonic() + 20
    while True:  # the encoder flushes right after answering: its counts may trail the answer
        after = scrape(triton_url)
        if moved(after, "pergola_queue_wait_seconds_count", model="mini_encoder") >= REQUESTS:
            break
        assert time.monotonic() < deadline, "the encoder's histograms did not move"
        time.sleep(0.2)
    assert moved(after, "pergola_tokenize_seconds_count", model="mini_tokenizer") == REQUESTS
    assert moved(after, "pergola_tokenize_seconds_sum", model="mini_tokenizer") > 0
    assert moved(after, "pergola_queue_wait_seconds_count", model="mini_encoder") == REQUESTS
    assert moved(after, "pergola_step_tokens_sum", model="mini_encoder") == tokens
    assert moved(after, "pergola_tokens_total", model="mini_encoder") == tokens
    steps = moved(after, "pergola_step_seconds_count", model="mini_encoder")
    assert 1 <= steps == moved(after, "pergola_step_tokens_count", model="mini_encoder")
    assert 0 < moved(after, "pergola_step_seconds_sum", model="mini_encoder") < 60
    for name in ("pergola_step_seconds", "pergola_step_tokens", "pergola_queue_wait_seconds"):
        buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in after.items()
                         if n == f"{name}_bucket" and ("model", "mini_encoder") in ls)
        assert [v for _, v in buckets] == sorted(v for _, v in buckets), f"{name}: buckets are not cumulative"
        assert buckets[-1] == (float("inf"), value(after, f"{name}_count", model="mini_encoder"))
    assert value(after, "pergola_info", model="mini_encoder", hub_id=REPO_ID, revision=MAIN, dtype="float32") == 1

    gateway = scrape(f"{base}/metrics")
    assert value(gateway, "pergola_gateway_requests_total", route="/embed", status="200") - \
        value(gateway_before, "pergola_gateway_requests_total", route="/embed", status="200") == REQUESTS
    assert value(gateway, "pergola_gateway_request_duration_seconds_count", route="/embed") - \
        value(gateway_before, "pergola_gateway_request_duration_seconds_count", route="/embed") == REQUESTS
    assert value(gateway, "pergola_gateway_requests_total", route="other", status="404") >= 1
    assert value(gateway, "pergola_gateway_requests_in_flight") == 1  # the scrape itself
