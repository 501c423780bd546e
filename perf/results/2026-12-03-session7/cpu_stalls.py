"""Batch-1 requests straight to the encoder of a CPU server, over gRPC and HTTP: p50, mean, p99 and
requests over 300 ms. Run from the repository root: MODEL=minilm THREADS=2 python perf/results/2026-12-03-session7/cpu_stalls.py
(THREADS: EngineConfig.cpu_threads, 0 = auto). Session 7, perf/RESULTS.md."""
import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "perf"); sys.path.insert(0, "python_models")
import numpy as np
import bench_engine
bench_engine.DEVICE = "cpu"
from bench_engine import model_folder
from inputs import TokenWindows
from pergola.hf_folder import load_model_spec
from pergola.repo_builder import build_repository, entry_from_folder
from pergola.server import ServerOptions, free_port, start, wait_ready
wd = Path(tempfile.mkdtemp(prefix="stall-"))
import os
folder = model_folder(os.environ.get("MODEL", "qwen3-tiny"), wd)
spec = load_model_spec(folder)
win = TokenWindows(spec.tokenizer_file)
repo = build_repository(wd / "repo", [entry_from_folder(folder, "bench", cpu_threads=int(os.environ.get("THREADS", "0")))], gpu=False)
opts = ServerOptions(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
srv = start(opts, log_path=wd / "tritonserver.log")
try:
    wait_ready(opts.http_port, srv, timeout=300)
    ids = win.ids(128, 1, seed=1)[0][None, :].astype(np.int64)
    lengths = np.array([[ids.shape[1]]], dtype=np.int32)
    import tritonclient.grpc as g, tritonclient.http as h
    for name, mod, url in (("grpc", g, f"127.0.0.1:{opts.grpc_port}"), ("http", h, f"127.0.0.1:{opts.http_port}")):
        c = mod.InferenceServerClient(url)
        def call():
            a = mod.InferInput("INPUT_IDS", list(ids.shape), "INT64"); a.set_data_from_numpy(ids)
            b = mod.InferInput("LENGTHS", list(lengths.shape), "INT32"); b.set_data_from_numpy(lengths)
            return c.infer("bench_encoder", [a, b]).as_numpy("EMBEDDING")
        for _ in range(5): call()
        ms, t_start = [], time.perf_counter()
        for i in range(300):
            t0 = time.perf_counter(); call(); ms.append((time.perf_counter() - t0) * 1e3)
        slow = [(i, round(v)) for i, v in enumerate(ms) if v > 300]
        print(name, "p50 %.2f mean %.2f p99 %.1f" % (np.median(ms), np.mean(ms), np.percentile(ms, 99)), "stalls >300 ms:", len(slow), flush=True)
finally:
    srv.terminate(); srv.wait()
    print(open(wd / "tritonserver.log").read()[-1500:])
