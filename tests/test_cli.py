"""The command line: `pergola serve` (what `make serve` runs) and `pergola embed`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import TEXTS, cosine_rows


def test_embed_command_prints_json(server, reference):
    out = subprocess.run(
        [sys.executable, "-m", "pergola.cli", "embed", "--url", server.grpc_url, TEXTS[0], TEXTS[2]],
        capture_output=True, text=True, timeout=60, check=True,
    )
    data = json.loads(out.stdout)["data"]
    vectors = np.array([row["embedding"] for row in data], dtype=np.float32)
    assert [row["text"] for row in data] == [TEXTS[0], TEXTS[2]]
    assert cosine_rows(vectors, reference[[0, 2]]).min() >= 0.9999


def test_serve_command_serves_embed(tmp_path, minilm_folder, reference):
    from pergola.server import free_port, wait_ready
    from pergola_client import PergolaClient

    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "pergola.cli", "serve", "--model", f"mini={minilm_folder}",
           "--repo", str(tmp_path / "repo"), "--device", "cpu", "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(http, proc, timeout=240)
        with PergolaClient(f"127.0.0.1:{http}", protocol="http") as client:
            out = client.embed(TEXTS[:2])
        assert cosine_rows(out, reference[:2]).min() >= 0.9999
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_recovers_when_the_encoder_stub_dies(tmp_path, minilm_folder, reference):
    """Kill the encoder's Python stub under `pergola serve`: requests fail briefly, then the
    supervisor reloads the model and answers are correct again."""
    import os
    import signal
    import time

    from pergola.server import free_port, wait_ready
    from pergola.supervisor import live_stubs, stub_pids
    from pergola_client import PergolaClient

    http, grpc, metrics = free_port(), free_port(), free_port()
    repo = tmp_path / "repo"
    cmd = [sys.executable, "-m", "pergola.cli", "serve", "--model", f"mini={minilm_folder}", "--repo", str(repo),
           "--device", "cpu", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_ready(http, proc, timeout=240)
        assert live_stubs(repo) == {"mini_tokenizer": 2, "mini_encoder": 1}
        [stub] = stub_pids(repo)["mini_encoder"]
        os.kill(stub, signal.SIGKILL)
        deadline, out = time.monotonic() + 120, None
        with PergolaClient(f"127.0.0.1:{grpc}") as client:
            while time.monotonic() < deadline:
                try:
                    out = client.embed(TEXTS[:2])
                    break
                except Exception:  # noqa: BLE001 - "stub not healthy" until the reload is done
                    time.sleep(1)
        assert out is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert cosine_rows(out, reference[:2]).min() >= 0.9999
        assert stub_pids(repo)["mini_encoder"] != [stub]
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)



def test_version_swap_under_load_fails_no_request(tmp_path, minilm_folder, reference):
    """Steady traffic while `pergola add-version` loads version 2 (CLS instead of mean pooling):
    no request fails, and afterwards answers come from version 2."""
    import threading
    import time

    from conftest import derived_folder
    from pergola.server import free_port, wait_ready
    from pergola_client import PergolaClient
    from sentence_transformers import SentenceTransformer

    v2 = derived_folder(minilm_folder, tmp_path / "v2", pooling={"pooling_mode_mean_tokens": False,
                                                                 "pooling_mode_cls_token": True})
    expected_v2 = SentenceTransformer(str(v2), device="cpu").encode(TEXTS[:2])
    http, grpc, metrics = free_port(), free_port(), free_port()
    repo = tmp_path / "repo"
    cmd = [sys.executable, "-m", "pergola.cli", "serve", "--model", f"mini={minilm_folder}", "--repo", str(repo),
           "--device", "cpu", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    results: list = []
    stop = threading.Event()

    def traffic() -> None:
        with PergolaClient(f"127.0.0.1:{grpc}") as client:
            while not stop.is_set():
                try:
                    results.append(client.embed(TEXTS[:2]))
                except Exception as e:  # noqa: BLE001 - a failure is what this test looks for
                    results.append(e)
                time.sleep(0.02)

    try:
        wait_ready(http, proc, timeout=240)
        thread = threading.Thread(target=traffic)
        thread.start()
        time.sleep(1.0)
        subprocess.run([sys.executable, "-m", "pergola.cli", "add-version", "--repo", str(repo), "--name", "mini",
                        "--model", str(v2), "--url", f"http://127.0.0.1:{http}"], check=True, timeout=300)
        time.sleep(1.0)
        stop.set()
        thread.join(timeout=60)
        with PergolaClient(f"127.0.0.1:{grpc}") as client:
            after = client.embed(TEXTS[:2])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    failures = [r for r in results if isinstance(r, Exception)]
    assert not failures, failures[:3]
    assert len(results) > 10
    assert cosine_rows(results[0], reference[:2]).min() >= 0.9999  # version 1 before the swap
    assert cosine_rows(after, expected_v2).min() >= 0.9999  # version 2 after it
    assert cosine_rows(after, reference[:2]).min() < 0.99
