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
