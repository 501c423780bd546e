"""The command line: `pergola serve` (what `make serve` runs) and `pergola embed`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from conftest import TEXTS, cosine_rows, start_serve


def test_embed_command_prints_json(server, reference):
    out = subprocess.run(
        [sys.executable, "-m", "pergola.cli", "embed", "--url", server.grpc_url, TEXTS[0], TEXTS[2]],
        capture_output=True, text=True, timeout=60, check=True,
    )
    data = json.loads(out.stdout)["data"]
    vectors = np.array([row["embedding"] for row in data], dtype=np.float32)
    assert [row["text"] for row in data] == [TEXTS[0], TEXTS[2]]
    assert cosine_rows(vectors, reference[[0, 2]]).min() >= 0.9999


def test_serve_command_serves_embed(served_gateway, reference):
    """`pergola serve` (conftest's served_gateway, as `make serve` runs it) serves `embed` on
    Triton's HTTP port too."""
    from pergola_client import PergolaClient

    with PergolaClient(f"127.0.0.1:{served_gateway.served.http}", protocol="http") as client:
        out = client.embed(TEXTS[:2])
    assert cosine_rows(out, reference[:2]).min() >= 0.9999


def test_version_swap_under_load_fails_no_request(tmp_path, minilm_folder, reference):
    """Steady traffic while `pergola add-version` loads version 2 (CLS instead of mean pooling):
    no request fails, and afterwards answers come from version 2, over Triton's gRPC and through
    the gateway (which tokenizes short texts itself and calls the encoder version it read the
    tokenizer of: a version gone since is answered through the ensemble)."""
    import threading
    import time
    import urllib.request

    from conftest import derived_folder
    from pergola_client import PergolaClient
    from sentence_transformers import SentenceTransformer
    from test_gateway import wait_for_answers

    v2 = derived_folder(minilm_folder, tmp_path / "v2", pooling={"pooling_mode_mean_tokens": False,
                                                                 "pooling_mode_cls_token": True})
    short = [TEXTS[0], TEXTS[2]]  # under --gateway-tokenize-chars: tokenized in the gateway
    expected_v2 = SentenceTransformer(str(v2), device="cpu").encode([*TEXTS[:2], *short])
    expected_v2, expected_v2_short = expected_v2[:2], expected_v2[2:]
    served = start_serve(tmp_path, f"mini={minilm_folder}")
    grpc = served.grpc
    results: list = []
    stop = threading.Event()

    def through_gateway() -> np.ndarray:
        body = json.dumps({"model": "mini", "input": short}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{served.gateway}/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return np.array([d["embedding"] for d in json.loads(r.read())["data"]], dtype=np.float32)

    def traffic() -> None:
        with PergolaClient(f"127.0.0.1:{grpc}") as client:
            while not stop.is_set():
                for call in (lambda: client.embed(TEXTS[:2]), through_gateway):
                    try:
                        results.append(call())
                    except Exception as e:  # noqa: BLE001 - a failure is what this test looks for
                        results.append(e)
                time.sleep(0.02)

    try:
        thread = threading.Thread(target=traffic)
        thread.start()
        wait_for_answers(results, 4)  # traffic through both doors before the swap
        subprocess.run([sys.executable, "-m", "pergola.cli", "add-version", "--repo", str(served.repo), "--name",
                        "mini", "--model", str(v2), "--url", f"http://127.0.0.1:{served.http}"], check=True, timeout=300)
        wait_for_answers(results, max(len(results) + 4, 12))  # and after it (over 10 in all)
        stop.set()
        thread.join(timeout=60)
        with PergolaClient(f"127.0.0.1:{grpc}") as client:
            after = client.embed(TEXTS[:2])
        after_gateway = through_gateway()
    finally:
        served.stop()
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert len(results) > 10
    assert cosine_rows(results[0], reference[:2]).min() >= 0.9999  # version 1 before the swap
    assert cosine_rows(results[1], reference[[0, 2]]).min() >= 0.9999  # (through the gateway)
    for answer, v2_answer, v1_answer in ((after, expected_v2, reference[:2]),
                                         (after_gateway, expected_v2_short, reference[[0, 2]])):
        assert cosine_rows(answer, v2_answer).min() >= 0.9999  # version 2 after it
        assert cosine_rows(answer, v1_answer).min() < 0.99

