"""A Batch API job against the same texts sent as direct bulk requests, and an online query's
latency while each runs (gateway/batch: a job's lines packed into calls on the encoders' bulk lane).

    python perf/bench_batch.py --model qwen3-0.6b --out perf/out/batch.json          # GPU
    python perf/bench_batch.py --device cpu --model minilm --length 32 -n 600 ...    # a quick CPU run

One tritonserver with the model as `bench` and the gateway in front (as `pergola serve` runs it:
texts tokenized in the gateway when short, inference over Triton's HTTP port). N texts of about
--length tokens:
  direct   POST /v1/embeddings, --batch texts a request, --clients threads with a keep-alive
           connection each (base64 answers, as the openai SDK asks): texts/s over the wall time
  job      the same texts as a JSONL of one-text lines (--line-texts; base64 answers too), uploaded, timed from
           POST /v1/batches to the poll that sees `completed` (validation included): texts/s
  queries  the ~8-word text query, sequential, 2 ms apart: idle, then while the direct bulk runs,
           then while the job runs (each bulk phase run again with the query client beside it)
Goal (issue 43, on a GPU): job >= 90% of the direct texts/s; the query's p99 while the job runs
<= 3x its idle p99. The job's answers are checked against the direct ones (cosine).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import gateway_option_values, pergola_stack  # noqa: E402
from bench_server import NAME  # noqa: E402
from common import cosine_min, drain, model_folder, percentiles, write_result  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from mixed import QUERY, QUERY_GAP_S  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402

DONE = ("completed", "failed", "cancelled", "expired")


class Client:
    """One keep-alive connection to the gateway (one per thread)."""

    def __init__(self, port: int, timeout: float = 600.0) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def call(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> dict:
        for attempt in range(2):  # (an idle keep-alive connection the server closed: reconnect once)
            try:
                self.conn.request(method, path, body, headers or {"Content-Type": "application/json"})
                response = self.conn.getresponse()
                data = response.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        if response.status != 200:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data)

    def embed(self, texts: list[str] | str) -> np.ndarray:
        out = self.call("POST", "/v1/embeddings", json.dumps({"model": NAME, "input": texts,
                                                              "encoding_format": "base64"}).encode())
        return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in out["data"]])

    def upload(self, data: bytes) -> str:
        boundary = "pergola-bench-boundary"
        body = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="lines.jsonl"\r\n\r\n'
                ).encode() + data + f"\r\n--{boundary}--\r\n".encode()
        return self.call("POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})["id"]


def direct_bulk(port: int, texts: list[str], batch: int, clients: int) -> tuple[dict, np.ndarray]:
    """The texts as /v1/embeddings requests of `batch`, `clients` threads -> (figures, vectors)."""
    requests = [(a, texts[a:a + batch]) for a in range(0, len(texts), batch)]
    vectors: dict[int, np.ndarray] = {}

    def client() -> Callable[[tuple[int, list[str]]], None]:
        gw = Client(port)
        return lambda item: vectors.__setitem__(item[0], gw.embed(item[1]))

    wall = drain(requests, clients, client)
    return ({"texts_per_s": len(texts) / wall, "seconds": wall, "requests": len(requests), "batch": batch,
             "clients": clients}, np.concatenate([vectors[a] for a, _ in requests]))


def job_lines(texts: list[str], line_texts: int) -> bytes:
    return b"".join(json.dumps({"custom_id": str(a), "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": NAME, "input": texts[a:a + line_texts],
                                         "encoding_format": "base64"}}).encode() + b"\n"
                    for a in range(0, len(texts), line_texts))


def run_job(port: int, file_id: str, texts: int) -> tuple[dict, dict]:
    """A batch of the uploaded file, polled every 50 ms until it ends -> (figures, the batch)."""
    gw = Client(port)
    t0 = time.perf_counter()
    batch = gw.call("POST", "/v1/batches", json.dumps({"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                                       "completion_window": "24h"}).encode())
    while batch["status"] not in DONE:
        time.sleep(0.05)
        batch = gw.call("GET", f"/v1/batches/{batch['id']}")
    wall = time.perf_counter() - t0
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise SystemExit(f"the job did not complete cleanly: {batch}")
    return {"texts_per_s": texts / wall, "seconds": wall, "lines": batch["request_counts"]["total"]}, batch


def job_vectors(port: int, batch: dict, texts: int, line_texts: int) -> np.ndarray:
    """The job's answers in input order."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("GET", f"/v1/files/{batch['output_file_id']}/content")
    rows = {}
    for line in conn.getresponse().read().splitlines():
        record = json.loads(line)
        rows[int(record["custom_id"])] = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
                                                   for d in record["response"]["body"]["data"]])
    return np.concatenate([rows[a] for a in range(0, texts, line_texts)])


def queries_during(port: int, load: Callable[[], object] | None, n: int) -> tuple[dict, object]:
    """The query's latency (ms) while load() runs (idle: `n` queries) -> (percentiles, load's result)."""
    gw = Client(port)
    latencies: list[float] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set() and (load is not None or len(latencies) < n):
            t0 = time.perf_counter()
            gw.embed(QUERY)
            latencies.append((time.perf_counter() - t0) * 1e3)
            time.sleep(QUERY_GAP_S)

    thread = threading.Thread(target=client)
    thread.start()
    result = None
    try:
        if load is not None:
            result = load()
        else:
            thread.join()
    finally:
        stop.set()
        thread.join()
    return percentiles(latencies), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "minilm", "qwen3-tiny"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("-n", type=int, default=20_000, help="texts")
    p.add_argument("--length", type=int, default=512, help="tokens a text (about)")
    p.add_argument("--batch", type=int, default=100, help="texts a direct request")
    p.add_argument("--clients", type=int, default=4, help="direct requests in flight")
    p.add_argument("--line-texts", type=int, default=1, help="texts a job line")
    p.add_argument("--idle-queries", type=int, default=200)
    p.add_argument("--gateway-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a GatewayOptions field, e.g. batch_call_chars=131072 (repeatable)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/batch.json")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-batch-"))
    folder = model_folder(args.model, workdir)
    texts = TokenWindows(load_model_spec(folder).tokenizer_file).texts(args.length, args.n, seed=43)
    options = {"batch_data": str(workdir / "batch-data")} | gateway_option_values(args.gateway_option)
    res: dict = {"model": args.model, "device": args.device, "command": " ".join(sys.argv), "n": args.n,
                 "length": args.length, "gateway_options": options,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    # (no load shedding: the direct bulk queues more work than a CPU finishes in the default 10 s)
    with contextlib.ExitStack() as stack:
        _, port = stack.enter_context(pergola_stack(folder, workdir, args.device == "gpu", options,
                                                    max_queue_seconds=0.0))
        if port is None:
            raise SystemExit("the gateway never answered: nothing to measure (its log is above)")
        gw = Client(port)
        gw.embed(texts[:args.batch])  # warm-up: first compiles, captures and tokenizer loads
        lines = job_lines(texts, args.line_texts)
        files = [gw.upload(lines) for _ in range(2)]  # (one per job run: uploads are not timed)

        res["query_idle"], _ = queries_during(port, None, args.idle_queries)
        res["direct"], direct = direct_bulk(port, texts, args.batch, args.clients)
        res["job"], batch = run_job(port, files[0], args.n)
        res["job_vs_direct"] = res["job"]["texts_per_s"] / res["direct"]["texts_per_s"]
        res["cosine_min_job_vs_direct"] = cosine_min(job_vectors(port, batch, args.n, args.line_texts), direct)
        res["query_during_direct"], loaded = queries_during(
            port, lambda: direct_bulk(port, texts, args.batch, args.clients)[0], 0)
        res["direct_with_queries"] = loaded
        res["query_during_job"], loaded = queries_during(port, lambda: run_job(port, files[1], args.n)[0], 0)
        res["job_with_queries"] = loaded
        res["query_p99_job_vs_idle"] = res["query_during_job"]["p99"] / res["query_idle"]["p99"]
        res["query_p99_direct_vs_idle"] = res["query_during_direct"]["p99"] / res["query_idle"]["p99"]
    print(f"direct {res['direct']['texts_per_s']:.1f} texts/s, job {res['job']['texts_per_s']:.1f} "
          f"({res['job_vs_direct']:.3f}); cosine job vs direct >= {res['cosine_min_job_vs_direct']:.6f}")
    for phase in ("query_idle", "query_during_direct", "query_during_job"):
        q = res[phase]
        print(f"  {phase}: p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms (n {q['n']})")
    print(f"  query p99 while the job runs / idle: {res['query_p99_job_vs_idle']:.2f} "
          f"(while direct bulk runs: {res['query_p99_direct_vs_idle']:.2f})", flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
