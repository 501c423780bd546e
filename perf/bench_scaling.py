"""Throughput over the GPUs of one host: embeddings/s at N = 1, 2, 4 ... GPUs, in two layouts.

    python perf/bench_scaling.py --gpus 1 2 4 --out perf/out/scaling.json
    python perf/bench_scaling.py --device cpu --model qwen3-tiny --gpus 1 2 --lengths 128   # plumbing only

  one_server  one tritonserver whose encoder has one instance on each of the first N GPUs
              (instance_group `gpus: [0 .. N-1]`); Triton's dynamic batcher spreads requests over the
              instances. Clients: bench_server's throughput suite over gRPC to NAME_encoder.
  per_gpu     one tritonserver per GPU (its encoder on that GPU alone) behind one gateway that lists
              them all (`--triton`, `--triton-http-port`) and spreads chunks over them, least
              outstanding first. Clients: the same batches to the gateway's /v1/embeddings (base64).
Each point: `--procs-per-gpu` client processes per GPU, each sending `--requests` batches of 100
pre-tokenized sequences of each length (the seed suites' inputs). Efficiency is emb/s at N over N x
emb/s at N = 1 of the same layout; the several-GPUs issue asks >= 0.9 at N = 2 and 4. On the CPU
(`--device cpu`) each "GPU" is a CPU instance: a check of the plumbing, not a scaling figure.
vLLM's data-parallel mode is measured by perf/bench_vllm.py.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import _first_answer, _gateway_worker, spawn_gateway, triton_servers  # noqa: E402
from bench_server import NAME, _throughput_worker, run_client_processes  # noqa: E402
from common import model_folder, write_result  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.triton.server import ServerOptions, free_port  # noqa: E402

LAYOUTS = ("one_server", "per_gpu")


def encoder_requests(server: ServerOptions) -> int:
    """Requests NAME_encoder answered on `server` (Triton's nv_inference_request_success): how the
    gateway spread the chunks."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return int(sum(s.value for family in text_string_to_metric_families(body)
                   if family.name == "nv_inference_request_success"
                   for s in family.samples if s.labels.get("model") == f"{NAME}_encoder"))


def measure(layout: str, n: int, folder: Path, workdir: Path, args: argparse.Namespace,
            windows: TokenWindows) -> dict | None:
    """{"lengths": length -> the throughput suite's row, "encoder_requests_per_server": [...]} for
    `layout` over the first `n` GPUs (n CPU instances with --device cpu); None: not measurable here."""
    gpu = args.device == "gpu"
    if layout == "one_server":
        groups = [list(range(n)) if gpu else None]
        if not gpu and n > 1:
            return None  # one CPU server has one encoder instance: nothing to spread over
    else:
        groups = [[i] if gpu else None for i in range(n)]
    procs = args.procs_per_gpu * n
    out: dict[str, dict] = {}  # length -> row
    with triton_servers(folder, workdir / f"{layout}_{n}", gpu, groups) as servers:
        with contextlib.ExitStack() as stack:
            if layout == "one_server":
                worker, endpoint = _throughput_worker, (f"127.0.0.1:{servers[0].grpc_port}",)
            else:
                port = free_port()
                stack.callback(spawn_gateway(servers, port, gateway_workers=args.gateway_workers).terminate)
                if _first_answer(port, deadline=time.monotonic() + 120) is None:
                    raise RuntimeError("the gateway never answered: see the message above")
                worker, endpoint = _gateway_worker, (port,)
            for length in args.lengths:
                run_client_processes(worker, endpoint, windows, length, procs=procs, requests_per_proc=1)  # warm-up
                row = run_client_processes(worker, endpoint, windows, length, procs=procs,
                                           requests_per_proc=args.requests)
                out[str(length)] = row
                print(f"  {layout:10s} N={n} {length:5d} tok: {row['embeddings_per_s']:8.1f} emb/s "
                      f"({procs} client processes)", flush=True)
        spread = [encoder_requests(s) for s in servers]
    return {"lengths": out, "encoder_requests_per_server": spread}


def efficiency(points: dict[str, dict]) -> dict[str, dict[str, float]]:
    """N -> length -> emb/s at N / (N x emb/s at 1), for the N measured beside N = 1."""
    base = points.get("1", {}).get("lengths", {})
    return {n: {length: row["embeddings_per_s"] / (int(n) * base[length]["embeddings_per_s"])
                for length, row in point["lengths"].items() if length in base}
            for n, point in points.items() if n != "1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "minilm", "qwen3-tiny"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4], help="the N to measure (the first N GPUs)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--procs-per-gpu", type=int, default=4, help="client processes per GPU")
    p.add_argument("--requests", type=int, default=4, help="timed batches of 100 per client process")
    p.add_argument("--gateway-workers", type=int, default=1, help="per_gpu: the gateway's worker processes")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/scaling.json")
    args = p.parse_args()
    if args.device == "gpu":
        import torch

        seen = torch.cuda.device_count()
        if max(args.gpus) > seen:
            p.error(f"--gpus asks for {max(args.gpus)} GPUs, this host has {seen}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-scaling-"))
    folder = model_folder(args.model, workdir)
    windows = TokenWindows(load_model_spec(folder).tokenizer_file)
    res: dict = {"model": args.model, "device": args.device, "command": " ".join(sys.argv),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layouts": {}}
    for layout in args.layouts:
        points = {str(n): measure(layout, n, folder, workdir, args, windows) for n in sorted(set(args.gpus))}
        points = {n: point for n, point in points.items() if point is not None}
        res["layouts"][layout] = {"points": points, "efficiency": efficiency(points)}
        for n, rows in res["layouts"][layout]["efficiency"].items():
            print(f"  {layout:10s} N={n} efficiency: " + ", ".join(f"{k} tok {v:.2f}" for k, v in rows.items()),
                  flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
