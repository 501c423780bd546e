"""Mixed traffic: a query's latency while bulk embedding saturates the server (the fifth suite).

    python perf/bench_mixed.py --model qwen3-0.6b --out perf/out/mixed.json
    python perf/bench_vllm.py --suites mixed          # vLLM 0.22's server, same inputs and driver

One tritonserver with the model as `bench` (its encoder `bench_encoder`) and the gateway in front.
Queries, sequential, batch 1: 128 pre-tokenized tokens to the encoder over gRPC and over HTTP
(tritonclient), a ~8-word text through the `embed` ensemble (gRPC) and through the gateway's
/v1/embeddings. Bulk loads, four client processes each: 100 x 512 and 25 x 4,096 pre-tokenized
tokens to the encoder (gRPC), and 100 texts of ~512 tokens through `embed`; `--bulk-door gateway`
sends the bulk through the gateway's /v1/embeddings instead (token ids or texts, float answers),
so that its parsing and rendering share the gateway with the queries. perf/mixed.py says
how each load is timed; the goal (issue: one engine for both traffic patterns) is loaded p99
<= 3x idle p99, p50 <= 2x idle p50, and the bulk keeping >= 95% of its throughput.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixed  # noqa: E402
from bench_gateway import Gateway, pergola_stack  # noqa: E402
from bench_server import grpc_client, infer_text, infer_tokens  # noqa: E402
from common import model_folder, write_result  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from mixed import LOADS, QUERY  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.triton.server import ServerOptions  # noqa: E402


# --- senders (module level: the bulk processes are spawned) -----------------------------------
def grpc_ids_sender(url: str):
    mod, client = grpc_client(url)
    return lambda seqs: infer_tokens(client, mod, seqs)


def grpc_text_sender(url: str):
    mod, client = grpc_client(url)
    return lambda texts: infer_text(client, mod, texts)


def http_ids_sender(url: str):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    return lambda seqs: infer_tokens(client, httpclient, seqs)


def gateway_ids_sender(port: int):
    """Bulk token ids to the gateway's /v1/embeddings (each request's JSON built once)."""
    gw = Gateway(port)
    bodies: dict[int, bytes] = {}

    def send(seqs: list) -> np.ndarray:
        if id(seqs) not in bodies:
            bodies[id(seqs)] = gw.body([s.tolist() if hasattr(s, "tolist") else s for s in seqs])
        return gw.post(bodies[id(seqs)])
    return send


gateway_text_sender = gateway_ids_sender  # (texts are JSON strings in the same field)


def _bound(make_sender, url: str, payload):
    send = make_sender(url)
    return lambda: send(payload)


def _gateway_text(port: int):
    gw = Gateway(port)
    return lambda: gw.embed([QUERY])


def query_kinds(opts: ServerOptions, gw_port: int | None, windows: TokenWindows) -> mixed.QueryKinds:
    grpc, http = f"127.0.0.1:{opts.grpc_port}", f"127.0.0.1:{opts.http_port}"
    ids = windows.ids(128, 1, seed=128)
    return {"grpc_ids_128": partial(_bound, grpc_ids_sender, grpc, ids),
            "http_ids_128": partial(_bound, http_ids_sender, http, ids),
            "grpc_text": partial(_bound, grpc_text_sender, grpc, [QUERY])} | (
            {"gateway_text": partial(_gateway_text, gw_port)} if gw_port else {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "minilm", "qwen3-tiny"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("-n", type=int, default=150, help="queries of each kind per load")
    p.add_argument("--gpus", type=int, default=None,
                   help="an encoder instance on each of the first N GPUs (default: every GPU, one each)")
    p.add_argument("--procs", type=int, default=None, help="bulk client processes (default: 4 per GPU used)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an encoder option for this run, e.g. query_tokens=0 (the single lane)")
    p.add_argument("--query-gap-ms", type=float, default=mixed.QUERY_GAP_S * 1e3,
                   help="the query client's pause between queries (sets the query rate)")
    p.add_argument("--no-gateway", action="store_true", help="Triton's doors only")
    p.add_argument("--bulk-door", default="grpc", choices=["grpc", "gateway"],
                   help="where the bulk processes send: Triton's gRPC port, or the gateway's /v1/embeddings")
    p.add_argument("--queries", nargs="+", default=None, metavar="KIND",
                   help="query kinds to time (default all: grpc_ids_128 http_ids_128 grpc_text gateway_text)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/mixed.json")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-mixed-"))
    folder = model_folder(args.model, workdir)
    windows = TokenWindows(load_model_spec(folder).tokenizer_file)
    options = {k: type_of(v) for k, v in (o.split("=", 1) for o in args.option)}
    res: dict = {"system": "pergola", "model": args.model, "device": args.device, "options": options,
                 "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "loads": {}}
    # No load shedding: the bulk clients keep more work queued than the default 10 s allows on a CPU.
    gpus = list(range(args.gpus)) if args.gpus else None
    procs = args.procs or 4 * (args.gpus or (gpu_count() if args.device == "gpu" else 1))
    res["gpus"] = args.gpus or "all"  # (each load records its bulk processes)
    with pergola_stack(folder, workdir, args.device == "gpu", not args.no_gateway, gpus=gpus, max_queue_seconds=0.0,
                       **options) as (opts, gw):
        kinds = query_kinds(opts, gw, windows)
        kinds = {k: v for k, v in kinds.items() if args.queries is None or k in args.queries}
        res["idle"] = mixed.idle_latency(kinds, args.n)
        print("idle: " + ", ".join(f"{k} p50 {v['p50']:.2f} p99 {v['p99']:.2f} ms" for k, v in res["idle"].items()),
              flush=True)
        through_gateway = args.bulk_door == "gateway"
        if through_gateway and gw is None:
            raise SystemExit("--bulk-door gateway needs the gateway (it did not answer, or --no-gateway)")
        endpoint = (gw,) if through_gateway else (f"127.0.0.1:{opts.grpc_port}",)
        res["bulk_door"] = args.bulk_door
        for name in args.loads:
            print(f"{name}:", flush=True)
            how, batches = mixed.bulk_batches(windows, name, procs)
            sender = {("ids", False): grpc_ids_sender, ("text", False): grpc_text_sender,
                      ("ids", True): gateway_ids_sender, ("text", True): gateway_text_sender}[how, through_gateway]
            row = res["loads"][name] = mixed.run_load(kinds, sender, endpoint, batches, n=args.n,
                                                      gap_s=args.query_gap_ms / 1e3)
            row["goal"] = mixed.verdict(res["idle"], row["loaded"], row["bulk_kept"])
    write_result(res, args.out)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def type_of(value: str) -> object:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


if __name__ == "__main__":
    main()
