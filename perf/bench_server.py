"""The seed article's suites through a running tritonserver with real gRPC clients.

    python perf/bench_server.py --model qwen3-0.6b --suites latency throughput concurrency \
        --out perf/out/server.json
    python perf/bench_server.py --model bge-m3-tiny --device cpu --out perf/out/server_cpu.json  # dry run

Models: the seeded Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B shapes, all-MiniLM-L6-v2's real
weights, and the architectures of perf/common.py's ARCH_MODELS in their published shapes (seeded,
BF16): bge-m3 (XLM-RoBERTa large, CLS; its sparse and ColBERT heads are in the folder, but the
suites leave OUTPUTS at its default, dense only, as vLLM's embed task computes) and gte-modernbert (gte-modernbert-base, ModernBERT with a 128-token
local window in two layers of three). Each NAME has a NAME-tiny twin in the CI shape for --device cpu.
Lengths per model are common.py's LAT_LENGTHS and TPUT_LENGTHS; below, the 8,192-token models'.

Starts pergola's tritonserver on free ports with the model as `embed`, checks its outputs
against Hugging Face transformers on the same weights, then runs:
  latency      pre-tokenized, batch 1, sequential, 128 / 512 / 4096 tokens   -> NAME_encoder
  throughput   batch 100, four client processes, 512 / 1024 / 4096 tokens    -> NAME_encoder
  concurrency  text, batch 1, 512 tokens, 1 / 2 / 4 / 8 / 16 in flight        -> embed ensemble
               (tokenization and the network hop count)
  perf_analyzer  the latency suite again through perf_analyzer (--input-data JSON), if present
  scoring      (a reranker model) pre-tokenized batches of 5 / 25 / 50 pairs of 512 tokens,
               sequential                                                    -> NAME_encoder
The baseline, measured in the same run on the same GPU: HF transformers in-process (BF16, SDPA,
padded batches of 32), which is what sentence-transformers runs; for the concurrency suite it
tokenizes too; for scoring, AutoModelForCausalLM scored as the official Qwen3-Reranker code does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    EMBED_MODELS,
    LAT_LENGTHS,
    LONG_LAT,
    LONG_TPUT,
    TPUT_LENGTHS,
    HFBaseline,
    cosine_min,
    encoder_start_lines,
    model_folder,
    percentiles,
    time_latency,
    time_throughput,
    write_result,
)
from inputs import TokenWindows  # noqa: E402
from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.triton.repo_builder import build_repository, entry_from_folder  # noqa: E402
from pergola.triton.server import ServerOptions, local_ports, start, wait_ready  # noqa: E402

NAME = "bench"


def grpc_client(url: str):
    import tritonclient.grpc as grpcclient

    return grpcclient, grpcclient.InferenceServerClient(url)


def infer_tokens(client, mod, seqs: list[np.ndarray], output: str = "EMBEDDING") -> np.ndarray:
    """Pre-tokenized sequences straight to the encoder: [1, T] ids + [1, n] lengths."""
    ids = np.concatenate(seqs)[None, :]
    lengths = np.array([[len(s) for s in seqs]], dtype=np.int32)
    a = mod.InferInput("INPUT_IDS", list(ids.shape), "INT64")
    a.set_data_from_numpy(ids)
    b = mod.InferInput("LENGTHS", list(lengths.shape), "INT32")
    b.set_data_from_numpy(lengths)
    return client.infer(f"{NAME}_encoder", [a, b]).as_numpy(output)


def infer_text(client, mod, texts: list[str]) -> np.ndarray:
    t = mod.InferInput("TEXT", [len(texts)], "BYTES")
    t.set_data_from_numpy(np.array([x.encode() for x in texts], dtype=object))
    return client.infer("embed", [t]).as_numpy("EMBEDDING")


# --- throughput: four client processes, batch 100 -------------------------------------------
def _throughput_worker(url: str, batches: list[list[np.ndarray]], barrier, q: mp.Queue) -> None:
    mod, client = grpc_client(url)
    infer_tokens(client, mod, batches[0])  # connection warm-up
    barrier.wait()  # all processes start together, after their (slow) imports
    t0 = time.time()
    for batch in batches:
        infer_tokens(client, mod, batch)
    q.put((len(batches), t0, time.time()))


def run_client_processes(worker, endpoint: tuple, windows: TokenWindows, length: int, procs: int = 4,
                         batch: int = 100, requests_per_proc: int = 4) -> dict:
    """The throughput suite for any server: `procs` processes run `worker(*endpoint, batches,
    barrier, queue)`, start together behind the barrier, each sending `requests_per_proc` batches
    (seeds 10000 * process + request, the same for every system); embeddings/s over the wall time
    from the first start to the last finish."""
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    barrier = ctx.Barrier(procs)
    workers = []
    for p in range(procs):
        batches = [windows.ids(length, batch, seed=10_000 * p + i) for i in range(requests_per_proc)]
        w = ctx.Process(target=worker, args=(*endpoint, batches, barrier, q))
        w.start()
        workers.append(w)
    try:
        results = [q.get(timeout=300) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    wall = max(r[2] for r in results) - min(r[1] for r in results)
    n = sum(r[0] for r in results) * batch
    return {"embeddings_per_s": n / wall, "tokens_per_s": n * length / wall, "processes": procs,
            "batch": batch, "requests": sum(r[0] for r in results)}


def run_throughput(url: str, windows: TokenWindows, length: int, requests_per_proc: int = 4) -> dict:
    return run_client_processes(_throughput_worker, (url,), windows, length, requests_per_proc=requests_per_proc)


# --- concurrency: text, batch 1, N in flight (asyncio gRPC) ------------------------------------
async def _concurrency(url: str, texts: list[str], concurrency: int, total: int) -> list[float]:
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    latencies: list[float] = []
    counter = iter(range(total))

    async def one_stream() -> None:
        for i in counter:
            t = aio.InferInput("TEXT", [1], "BYTES")
            t.set_data_from_numpy(np.array([texts[i % len(texts)].encode()], dtype=object))
            t0 = time.perf_counter()
            await client.infer("embed", [t])
            latencies.append((time.perf_counter() - t0) * 1e3)

    await asyncio.gather(*(one_stream() for _ in range(concurrency)))
    await client.close()
    return latencies


def step_modes(metrics_url: str | None) -> Counter[str]:
    """The encoder's forward steps by mode (eager / warmup / capture / replay) from Triton's metrics."""
    if metrics_url is None:
        return Counter()
    body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    modes: Counter[str] = Counter()
    for line in body.splitlines():
        if line.startswith("pergola_steps_total{"):
            mode = re.search(r'mode="(\w+)"', line)
            if mode:
                modes[mode.group(1)] += int(float(line.rsplit(" ", 1)[1]))
    return modes


def run_concurrency(url: str, texts: list[str], levels: list[int], per_level: int,
                    metrics_url: str | None = None) -> dict:
    """Latency at N requests in flight; also the steps that captured a CUDA graph while measuring.

    Each level is warmed up with as many requests as it measures, so the graphs of the batch
    shapes it produces are captured first; a capture inside the measured window is reported.
    """
    out = {}
    for c in levels:
        asyncio.run(_concurrency(url, texts, c, per_level))  # warm-up: lazy graph captures of the buckets
        before = step_modes(metrics_url)
        t0 = time.perf_counter()
        lat = asyncio.run(_concurrency(url, texts, c, per_level))
        wall = time.perf_counter() - t0
        steps = dict(step_modes(metrics_url) - before)
        out[c] = percentiles(lat) | {"requests_per_s": len(lat) / wall, "steps_by_mode": steps}
        print(f"  concurrency {c:2d}: p50 {out[c]['p50']:.2f} ms, p99 {out[c]['p99']:.2f} ms, "
              f"{out[c]['requests_per_s']:.0f} req/s, steps {steps}", flush=True)
    return out


# --- scoring: a reranker, batches of pre-tokenized pairs -------------------------------------
class HFReranker:
    """The official Qwen3-Reranker scoring: causal LM logits at the last position, softmax(no, yes)."""

    def __init__(self, folder: Path, device: str) -> None:
        import torch
        from pergola.config.hf_folder import load_model_spec as spec_of
        from pergola.config.reranker import answer_ids as _yes_no_ids
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.no_id, self.yes_id = _yes_no_ids(spec_of(folder, task="rerank"))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                          attn_implementation="sdpa").to(device).eval()

    def __call__(self, seqs: list[np.ndarray]) -> np.ndarray:
        torch = self.torch
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for j, s in enumerate(seqs):  # left padding, as the official code does
            ids[j, n - len(s):] = torch.from_numpy(s)
            mask[j, n - len(s):] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits[:, -1]
            pair = torch.stack([logits[:, self.no_id], logits[:, self.yes_id]], 1).float()
            return torch.softmax(pair, 1)[:, 1].cpu().numpy()


def run_scoring(client, mod, windows: TokenWindows, hf: HFReranker | None, n: int, length: int) -> dict:
    out = {}
    for batch in (5, 25, 50):
        inputs = [windows.ids(length, batch, seed=100 * batch + i) for i in range(10)]
        row = {"pergola": time_latency(lambda x: infer_tokens(client, mod, x, "SCORE"), inputs, n)}
        if hf is not None:
            ours, ref = infer_tokens(client, mod, inputs[0], "SCORE"), hf(inputs[0])
            row["max_abs_diff_vs_hf"] = float(np.abs(ours - ref).max())
            row["hf"] = time_latency(hf, inputs, max(n // 4, 10))
        out[batch] = row
        print(f"  scoring {batch:2d} x {length} tok: pergola p50 {row['pergola']['p50']:.2f} p99 "
              f"{row['pergola']['p99']:.2f} ms" + (f", HF p50 {row['hf']['p50']:.2f} ms, max |diff| "
                                                    f"{row['max_abs_diff_vs_hf']:.4f}" if hf else ""), flush=True)
    return out


# --- perf_analyzer --------------------------------------------------------------------------
def run_perf_analyzer(url: str, windows: TokenWindows, length: int, workdir: Path) -> dict | None:
    exe = shutil.which("perf_analyzer")
    if exe is None:
        return None
    seqs = windows.ids(length, 16, seed=77)
    # Shapes without the batch dimension: perf_analyzer adds it (-b 1).
    data = {"data": [{"INPUT_IDS": {"content": s.tolist(), "shape": [len(s)]},
                      "LENGTHS": {"content": [len(s)], "shape": [1]}} for s in seqs]}
    data_file = workdir / f"pa_{length}.json"
    data_file.write_text(json.dumps(data))
    csv = workdir / f"pa_{length}.csv"
    cmd = [exe, "-m", f"{NAME}_encoder", "-u", url, "-i", "grpc", "-b", "1", "--input-data", str(data_file),
           "--concurrency-range", "1", "--measurement-interval", "3000", "--stability-percentage", "25", "--percentile", "50", "-f", str(csv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        return {"error": proc.stdout[-800:] + proc.stderr[-800:], "command": " ".join(cmd)}
    header, row = csv.read_text().splitlines()[:2]
    fields = dict(zip(header.split(","), row.split(",")))
    us = {k: float(v) for k, v in fields.items() if k.startswith("p") and k.endswith("latency")}
    return {"command": " ".join(cmd), "inferences_per_s": float(fields["Inferences/Second"]),
            "latency_ms": {k.split()[0]: v / 1e3 for k, v in us.items()}}


def engine_options(pairs: list[str], folder: Path) -> dict[str, object]:
    """--option NAME=VALUE pairs as EngineConfig values, typed and checked as config.pbtxt parameters are."""
    params = dict(pair.split("=", 1) for pair in pairs)
    cfg = EngineConfig.from_parameters(params, model_dir=str(folder))
    unknown = set(params) - set(vars(cfg))
    if unknown:
        raise SystemExit(f"--option: {sorted(unknown)} are not EngineConfig fields")
    return {name: getattr(cfg, name) for name in params}


def arg_parser() -> argparse.ArgumentParser:
    """The command line (a function, so that tests parse it without running anything)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=[*EMBED_MODELS, "qwen3-reranker-0.6b", "qwen3-reranker-tiny"])
    p.add_argument("--suites", nargs="+", default=["latency", "throughput", "concurrency", "perf_analyzer"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--latency-n", type=int, default=100)
    p.add_argument("--concurrency-n", type=int, default=200)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--eager-attention-backend", default="auto", help="e.g. flashinfer_fa2 for big steps")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an encoder option (EngineConfig field) for this run, e.g. quantization=fp8")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/server.json")
    return p


def main() -> None:
    args = arg_parser().parse_args()
    import common

    common.DEVICE = "cuda" if args.device == "gpu" else "cpu"
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder = model_folder(args.model, workdir)
    spec = load_model_spec(folder)
    windows = TokenWindows(spec.tokenizer_file)
    quick = args.device == "cpu"
    # Rerankers run the scoring suite only: their lengths serve perf_analyzer alone.
    lat_lengths = [128] if quick else LAT_LENGTHS.get(args.model, LONG_LAT)
    tput_lengths = [128] if quick else TPUT_LENGTHS.get(args.model, LONG_TPUT)
    conc_length = 128 if quick or args.model == "minilm" else 512

    rerank = args.model.startswith("qwen3-reranker")
    options = engine_options(args.option, folder)
    entry = entry_from_folder(folder, NAME, eager_attention_backend=args.eager_attention_backend,
                              task="rerank" if rerank else None, **options)
    repo = build_repository(workdir / "repo", [entry], gpu=args.device == "gpu")
    opts = ServerOptions(repo=repo, **local_ports())
    t0 = time.perf_counter()
    server = start(opts, log_path=workdir / "tritonserver.log")
    try:
        wait_ready(opts.http_port, server, timeout=300)
        ready_s = time.perf_counter() - t0
        print(f"server ready in {ready_s:.1f} s ({args.model}, {args.device})", flush=True)
        url = f"127.0.0.1:{opts.grpc_port}"
        mod, client = grpc_client(url)
        device = "cuda" if args.device == "gpu" else "cpu"
        res: dict = {"model": args.model, "device": args.device, "server_ready_s": ready_s,
                     "eager_attention_backend": args.eager_attention_backend, "options": options,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
        hf = None
        if rerank:  # a reranker runs the scoring suite only
            hf_rr = None if args.no_baseline else HFReranker(folder, device)
            res["scoring"] = run_scoring(client, mod, windows, hf_rr, args.latency_n, 128 if quick else 512)
            args.suites = []
        elif not args.no_baseline:
            hf = HFBaseline(folder, spec.pooling, spec.normalize, device=device)
            check = windows.ids(min(512, max(tput_lengths)), 8, seed=5)  # within the model's length limit
            res["min_cosine_vs_hf"] = cosine_min(infer_tokens(client, mod, check), hf(check))
            print(f"check vs HF transformers: min cosine {res['min_cosine_vs_hf']:.5f}", flush=True)
        if "latency" in args.suites:
            res["latency"] = {}
            for length in lat_lengths:
                inputs = [[s] for s in windows.ids(length, 20, seed=length)]
                row = {"pergola": time_latency(lambda x: infer_tokens(client, mod, x), inputs, args.latency_n)}
                if hf is not None:
                    row["hf"] = time_latency(hf, inputs, max(args.latency_n // 4, 10))
                res["latency"][length] = row
                print(f"  latency {length:5d} tok: pergola p50 {row['pergola']['p50']:.2f} p99 "
                      f"{row['pergola']['p99']:.2f} ms" + (f", HF p50 {row['hf']['p50']:.2f} ms" if hf else ""),
                      flush=True)
        if "throughput" in args.suites:
            res["throughput"] = {}
            for length in tput_lengths:
                row = {"pergola": run_throughput(url, windows, length, requests_per_proc=2 if quick else 4)}
                if hf is not None:
                    row["hf"] = time_throughput(hf, windows.ids(length, 100, seed=9), min_seconds=1.0)
                res["throughput"][length] = row
                print(f"  throughput 100 x {length} tok, 4 procs: pergola "
                      f"{row['pergola']['embeddings_per_s']:.0f} emb/s"
                      + (f", HF {row['hf']['embeddings_per_s']:.0f} emb/s" if hf else ""), flush=True)
        if "concurrency" in args.suites:
            texts = windows.texts(conc_length, 64, seed=3)
            res["concurrency"] = {"length": conc_length, "pergola": run_concurrency(
                url, texts, [1, 2] if quick else [1, 2, 4, 8, 16], 20 if quick else args.concurrency_n,
                metrics_url=f"http://127.0.0.1:{opts.metrics_port}/metrics")}
            if hf is not None:
                st_like = lambda batch: hf.encode_texts(batch)  # noqa: E731 - tokenize + forward, batch 1
                res["concurrency"]["hf_sequential"] = time_latency(st_like, [[t] for t in texts], 30)
        if "perf_analyzer" in args.suites:
            res["perf_analyzer"] = {str(n): run_perf_analyzer(url, windows, n, workdir) for n in lat_lengths}
            print(f"  perf_analyzer: {json.dumps(res['perf_analyzer'])[:600]}", flush=True)
        stats = client.get_inference_statistics(f"{NAME}_encoder", as_json=True)
        res["triton_encoder_stats"] = stats.get("model_stats", [{}])[0].get("batch_stats", [])
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    res["encoder_start"] = encoder_start_lines(workdir / "tritonserver.log")
    write_result(res, args.out)


if __name__ == "__main__":
    main()
