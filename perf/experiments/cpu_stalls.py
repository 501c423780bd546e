"""Batch-1 requests straight to the encoder of a CPU server, over gRPC and HTTP: p50, mean, p99 and
the requests over 300 ms (the half-second stalls of CPU instances, perf/RESULTS.md).

    MODEL=minilm THREADS=2 python perf/experiments/cpu_stalls.py

MODEL: a perf/common.py model name (default qwen3-tiny); THREADS: EngineConfig.cpu_threads
(0 = the cores less one). 300 requests of 128 tokens per client after 5 warm-ups.
"""

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "python_models"))
import common  # noqa: E402
from common import model_folder  # noqa: E402
from inputs import TokenWindows  # noqa: E402

from pergola.hf_folder import load_model_spec  # noqa: E402
from pergola.repo_builder import build_repository, entry_from_folder  # noqa: E402
from pergola.server import ServerOptions, free_port, start, wait_ready  # noqa: E402

common.DEVICE = "cpu"
wd = Path(tempfile.mkdtemp(prefix="stall-"))
folder = model_folder(os.environ.get("MODEL", "qwen3-tiny"), wd)
win = TokenWindows(load_model_spec(folder).tokenizer_file)
entry = entry_from_folder(folder, "bench", cpu_threads=int(os.environ.get("THREADS", "0")))
repo = build_repository(wd / "repo", [entry], gpu=False)
opts = ServerOptions(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
srv = start(opts, log_path=wd / "tritonserver.log")
try:
    wait_ready(opts.http_port, srv, timeout=300)
    ids = win.ids(128, 1, seed=1)[0][None, :].astype(np.int64)
    lengths = np.array([[ids.shape[1]]], dtype=np.int32)
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    for name, mod, url in (("grpc", grpcclient, f"127.0.0.1:{opts.grpc_port}"),
                           ("http", httpclient, f"127.0.0.1:{opts.http_port}")):
        client = mod.InferenceServerClient(url)

        def call(mod=mod, client=client) -> np.ndarray:
            a = mod.InferInput("INPUT_IDS", list(ids.shape), "INT64")
            a.set_data_from_numpy(ids)
            b = mod.InferInput("LENGTHS", list(lengths.shape), "INT32")
            b.set_data_from_numpy(lengths)
            return client.infer("bench_encoder", [a, b]).as_numpy("EMBEDDING")

        for _ in range(5):
            call()
        ms = []
        for _ in range(300):
            t0 = time.perf_counter()
            call()
            ms.append((time.perf_counter() - t0) * 1e3)
        slow = [v for v in ms if v > 300]
        print(f"{name} p50 {np.median(ms):.2f} mean {np.mean(ms):.2f} p99 {np.percentile(ms, 99):.1f}",
              "stalls >300 ms:", len(slow), flush=True)
finally:
    srv.terminate()
    srv.wait()
    print((wd / "tritonserver.log").read_text()[-1500:])
