"""Requests that wait 500 ms in Triton's dynamic batcher, by the encoder queue's policy.

    python perf/experiments/bench_queue_policy.py --policies limits none limits none \
        --out perf/out/queue_policy.json

One tritonserver per policy (qwen3-tiny, CPU), 2 and then 4 client threads (tritonclient.grpc,
one client each), 8 rounds of 10 sequential batch-1 calls of 128 pre-tokenized ids per thread,
0.2 or 1 s apart; reports the calls over 300 ms, p50 and p99.

  limits   the queue policy pergola wrote until 2026-12-05: max_queue_size 256, timeout REJECT,
           allow_timeout_override (Triton 2.51 then does not prefetch batches)
  none     no policy (the default since): max_queue_size 0, no timeouts, no override, so the
           batcher prefetches the next batch while execute() runs
  nobatch  no dynamic_batching block at all (one request per execute())

Why it happens (triton-inference-server/core, r24.10): the batcher is woken when its last batch
is dequeued by the instance, at the start of execute(), not at its end; a request that arrives
during execute() does not wake it (no free slot then), and nothing does when the instance frees,
so it waits for the batcher's 500 ms idle timeout. With prefetching a slot counts as free while
fewer than two batches are queued, so the new request wakes the batcher.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))
sys.path.insert(0, str(ROOT / "python_models"))

STALL_MS = 300.0


def build(workdir: Path, policy: str) -> tuple[Path, list[np.ndarray]]:
    """qwen3-tiny's repository with the encoder's queue as `policy` says, and the ids to send."""
    import common
    from common import model_folder
    from inputs import TokenWindows
    from pergola.hf_folder import load_model_spec
    from pergola.repo_builder import build_repository, entry_from_folder

    common.DEVICE = "cpu"
    folder = model_folder("qwen3-tiny", workdir)
    ids = TokenWindows(load_model_spec(folder).tokenizer_file).ids(128, 64, seed=3)
    limits = {"max_queue_size": 256} if policy == "limits" else {}
    repo = build_repository(workdir / policy, [entry_from_folder(folder, "bench", max_queue_seconds=0.0, **limits)],
                            gpu=False)
    cfg = repo / "bench_encoder" / "config.pbtxt"
    text = cfg.read_text()
    if policy == "limits":  # (what the template said then: the request's own timeout honoured in the queue)
        text = text.replace("allow_timeout_override: false", "allow_timeout_override: true")
    if policy == "nobatch":
        text = re.sub(r"dynamic_batching \{.*?\n\}\n", "", text, flags=re.S)
    cfg.write_text(text)
    return repo, ids


def measure(url: str, ids: list[np.ndarray]) -> list[float]:
    import tritonclient.grpc as grpcclient

    def call(client, x: np.ndarray) -> None:
        a = grpcclient.InferInput("INPUT_IDS", [1, x.size], "INT64")
        a.set_data_from_numpy(x[None].astype(np.int64))
        b = grpcclient.InferInput("LENGTHS", [1, 1], "INT32")
        b.set_data_from_numpy(np.array([[x.size]], dtype=np.int32))
        client.infer("bench_encoder", [a, b], outputs=[grpcclient.InferRequestedOutput("EMBEDDING")])

    latencies: list[float] = []
    for threads in (2, 4):
        for trial in range(8):
            time.sleep((0.2, 1.0)[trial % 2])

            def client(i: int) -> None:
                c = grpcclient.InferenceServerClient(url)
                for j in range(10):
                    t0 = time.perf_counter()
                    call(c, ids[(i * 10 + j) % len(ids)])
                    latencies.append((time.perf_counter() - t0) * 1e3)

            workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
    return latencies


def run(policy: str) -> dict:
    from pergola.server import ServerOptions, free_port, start, wait_ready

    workdir = Path(tempfile.mkdtemp(prefix="pergola-queue-policy-"))
    repo, ids = build(workdir, policy)
    opts = ServerOptions(repo=repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    proc = start(opts, log_path=workdir / "tritonserver.log")
    try:
        wait_ready(opts.http_port, proc, timeout=300)
        lat = np.array(measure(f"127.0.0.1:{opts.grpc_port}", ids))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"policy": policy, "requests": int(lat.size), "over_300_ms": int((lat > STALL_MS).sum()),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "max_ms": float(lat.max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["limits", "none", "limits", "none"],
                   choices=["limits", "none", "nobatch"])
    p.add_argument("--out", default="perf/out/queue_policy.json")
    args = p.parse_args()
    from common import write_result

    rows = []
    for policy in args.policies:
        row = run(policy)
        rows.append(row)
        print(f"{policy:8s} {row['requests']} requests, {row['over_300_ms']} over {STALL_MS:.0f} ms, "
              f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f}, max {row['max_ms']:.1f}", flush=True)
    write_result({"model": "qwen3-tiny", "device": "cpu", "command": " ".join(sys.argv),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": rows}, args.out)


if __name__ == "__main__":
    main()
