"""Load shedding: past the encoder's queue limit, requests are refused at once with a clear
"unavailable, retry" error; the server keeps answering and recovers when the load drops."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from conftest import TEXTS, cosine_rows


@pytest.fixture
def small_queue_server(tmp_path, minilm_folder):
    from pergola.repo_builder import build_repository, entry_from_folder
    from pergola.server import ServerOptions, free_port, start, wait_ready

    repo = build_repository(tmp_path / "repo", [entry_from_folder(minilm_folder, "mini", max_queue_size=2)],
                            gpu=False)
    opts = ServerOptions(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    proc = start(opts, log_path=tmp_path / "server.log")
    try:
        wait_ready(opts.http_port, proc, timeout=240)
        yield f"127.0.0.1:{opts.grpc_port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_overload_is_refused_quickly_and_the_server_recovers(small_queue_server, reference):
    from pergola_client import PergolaClient

    heavy = [TEXTS[1]] * 48  # 48 texts of 256 tokens: each request keeps the CPU encoder busy

    def call(_: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        try:
            with PergolaClient(small_queue_server) as client:
                client.embed(heavy)
            return "ok", time.perf_counter() - t0
        except InferenceServerException as e:
            return str(e), time.perf_counter() - t0

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(call, range(24)))
    refused = [(msg, s) for msg, s in results if msg != "ok"]
    assert any(msg == "ok" for msg, _ in results)
    assert refused, "24 concurrent heavy requests never exceeded a queue of 2"
    for msg, seconds in refused:
        assert "Exceeds maximum queue size" in msg and "UNAVAILABLE" in msg, msg
        assert seconds < 5.0  # refused at the door, not after waiting for the GPU/CPU
    with PergolaClient(small_queue_server) as client:  # load gone: normal service
        out = client.embed(TEXTS[:3])
    assert cosine_rows(out, reference[:3]).min() >= 0.9999
