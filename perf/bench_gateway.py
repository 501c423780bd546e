"""What the gateway costs and keeps: the same requests straight to Triton (gRPC) and through the
gateway (HTTP/JSON, OpenAI route), against one tritonserver on this machine.

    python perf/bench_gateway.py --model qwen3-0.6b --out perf/out/gateway.json

  latency      batch 1, sequential, the doors taking turns in blocks of 10 requests (paired under
               the same drift of the machine's speed): 128 pre-tokenized tokens (NAME_encoder vs
               /v1/embeddings with token ids) and a ~8-word text query (`embed` ensemble vs
               /v1/embeddings, tokenized in the gateway as `pergola serve` runs it, and through a
               second gateway that sends texts through the ensemble); the gateway's answers as float
               JSON and as base64 (the openai SDK's default); the gateway's added p50 is the difference
  throughput   batch 100 x 512 tokens pre-tokenized, four client processes (base64 answers, as
               the openai SDK asks) vs the same through tritonclient
  concurrency  512-token texts, 1 / 4 / 16 in flight (one keep-alive connection per client thread)
Outputs are checked: the gateway's vectors equal Triton's for the same input.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import (  # noqa: E402
    NAME,
    grpc_client,
    infer_text,
    infer_tokens,
    run_client_processes,
    run_throughput,  # noqa: E402
)
from common import drain, model_folder, percentiles, write_result  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from mixed import QUERY  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.gateway.app import spawn  # noqa: E402
from pergola.gateway.metrics import inputs_by_tokenizer  # noqa: E402
from pergola.gateway.options import GatewayOptions  # noqa: E402
from pergola.triton.repo_builder import build_repository, entry_from_folder  # noqa: E402
from pergola.triton.server import ServerOptions, free_port, local_ports, start, wait_ready  # noqa: E402


class Gateway:
    """One keep-alive HTTP connection to the gateway (one per thread or process)."""

    def __init__(self, port: int, timeout: float = 120.0) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def _send(self, body: bytes) -> tuple[http.client.HTTPResponse, dict]:
        for attempt in range(2):  # uvicorn closes keep-alive connections idle for 5 s: reconnect once
            try:
                self.conn.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                response = self.conn.getresponse()
                return response, json.loads(response.read())
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def embed(self, inputs: object, base64_out: bool = False) -> np.ndarray:
        return self.post(self.body(inputs, base64_out), base64_out)

    @staticmethod
    def body(inputs: object, base64_out: bool = False) -> bytes:
        """A /v1/embeddings request's JSON (built once, sent as often as wanted with `post`)."""
        return json.dumps({"model": NAME, "input": inputs} | ({"encoding_format": "base64"} if base64_out else {}),
                          separators=(",", ":")).encode()

    def post(self, body: bytes, base64_out: bool = False, busy_retries: int = 120) -> np.ndarray:
        """Send; a 429/503 (admission says busy) is retried after its Retry-After, as a well-behaved client does."""
        for _ in range(busy_retries + 1):
            response, out = self._send(body)
            if response.status not in (429, 503):
                break
            time.sleep(float(response.getheader("Retry-After") or 1))
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {out}")
        rows = [d["embedding"] for d in out["data"]]
        if base64_out:
            return np.stack([np.frombuffer(base64.b64decode(r), dtype="<f4") for r in rows])
        return np.asarray(rows, dtype=np.float32)


def _gateway_worker(port: int, batches: list[list[np.ndarray]], barrier, q) -> None:
    gw = Gateway(port)
    as_lists = [[s.tolist() for s in batch] for batch in batches]  # JSON bodies built before timing
    gw.embed(as_lists[0], base64_out=True)
    barrier.wait()
    gw = Gateway(port)  # (the warm-up connection may have idled out while the others started)
    t0 = time.time()
    for batch in as_lists:
        gw.embed(batch, base64_out=True)
    q.put((len(batches), t0, time.time()))


def concurrency(port: int, texts: list[str], in_flight: int, total: int) -> dict:
    latencies: list[float] = []

    def client() -> Callable[[int], None]:
        gw = Gateway(port)

        def one(i: int) -> None:
            t0 = time.perf_counter()
            gw.embed(texts[i % len(texts)])
            latencies.append((time.perf_counter() - t0) * 1e3)
        return one

    for measure in (False, True):  # the first pass warms up (lazy CUDA-graph captures)
        latencies.clear()
        wall = drain(range(total), in_flight, client)
    return percentiles(latencies) | {"requests_per_s": len(latencies) / wall}


@contextlib.contextmanager
def pergola_stack(folder: Path, workdir: Path, gpu: bool, gateway: bool | dict = True, gpus: list[int] | None = None,
                  **options) -> Iterator[tuple[ServerOptions, int | None]]:
    """tritonserver with `folder` as NAME (engine `options` as config parameters; an encoder
    instance on each of `gpus`, default every GPU it sees) and the gateway (`gateway`: a dict of
    GatewayOptions values for it, or False for none); -> (server ports, gateway port or None)
    once both answer."""
    with triton_servers(folder, workdir, gpu, [gpus], **options) as (opts,):
        # (`gateway` is False for none; an empty dict of options is the default gateway, not none)
        gw_port = free_port() if gateway is not False else None
        gw = gw_port and spawn_gateway([opts], gw_port, **(gateway if isinstance(gateway, dict) else {}))
        try:
            gw_port = gw_port and _first_answer(gw_port, deadline=time.monotonic() + 120)
            yield opts, gw_port
        finally:
            if gw:
                gw.terminate()


@contextlib.contextmanager
def triton_servers(folder: Path, workdir: Path, gpu: bool, groups: list[list[int] | None],
                   **options) -> Iterator[list[ServerOptions]]:
    """One tritonserver per entry of `groups` (the GPUs its encoder's instances take: None for
    every GPU it sees, or on the CPU), each with `folder` as NAME in its own repository (engine
    `options` as config parameters); -> their ports once every one is ready."""
    started: list[tuple[ServerOptions, subprocess.Popen, Path]] = []
    try:
        for i, gpus in enumerate(groups):
            suffix = str(i) if len(groups) > 1 else ""
            repo = build_repository(workdir / f"repo{suffix}", [entry_from_folder(folder, NAME, **options)], gpu=gpu,
                                    gpus=gpus)
            opts = ServerOptions(repo=repo, **local_ports())
            log = workdir / f"tritonserver{suffix}.log"
            started.append((opts, start(opts, log_path=log), log))
        for opts, proc, log in started:
            wait_ready(opts.http_port, proc, timeout=300)
            print(f"server ready (log: {log})", flush=True)
        yield [opts for opts, _, _ in started]
    finally:
        for _, proc, _ in started:
            proc.terminate()
        for _, proc, _ in started:
            proc.wait(timeout=60)


def spawn_gateway(servers: list[ServerOptions], port: int, **options):
    """The gateway in front of `servers` as `pergola serve` starts it (reading the first one's
    repository, inference to their HTTP ports; `--gateway-option triton_http_port=0` sends it
    over gRPC), spreading requests over them."""
    options = {"triton_http_port": ",".join(str(s.http_port) for s in servers)} | options
    return spawn(GatewayOptions(triton=",".join(f"127.0.0.1:{s.grpc_port}" for s in servers), gateway_port=port,
                                gateway_bind="127.0.0.1", models=NAME, triton_repository=str(servers[0].repo),
                                **options))


def gateway_option_values(pairs: list[str]) -> dict[str, object]:
    """--gateway-option NAME=VALUE pairs as GatewayOptions values, typed as its flags are."""
    from pergola.config.options import convert, declared

    fields = {f.name: f for f in declared(GatewayOptions)}
    out = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        if name not in fields:
            raise SystemExit(f"--gateway-option {pair!r}: {name!r} is not a GatewayOptions field "
                             f"({', '.join(sorted(fields))})")
        out[name] = convert(fields[name], raw, f"--gateway-option {name}")
    return out


def time_paired(calls: dict[str, Callable[[list], object]], inputs: list, n: int, block: int = 10,
                warmup: int = 3) -> dict[str, dict]:
    """Each call `n` times, taking turns in blocks of `block` (every other round in reverse
    order), so that drift in the machine's speed touches them alike; -> percentiles per call."""
    for call in calls.values():
        for i in range(warmup):
            call(inputs[i % len(inputs)])
    ms: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(-(-n // block)):
        for name in order if r % 2 == 0 else order[::-1]:
            for i in range(r * block, min(n, (r + 1) * block)):
                t0 = time.perf_counter()
                calls[name](inputs[i % len(inputs)])
                ms[name].append((time.perf_counter() - t0) * 1e3)
    return {name: percentiles(v) for name, v in ms.items()}


def tokenizes_texts(port: int, timeout_s: float = 60.0) -> bool:
    """Whether the gateway on `port` tokenizes a query itself, once its tokenizer has loaded (it
    loads on the first text; until then texts go through the ensemble): polls its metrics."""
    deadline = time.monotonic() + timeout_s
    gw = Gateway(port)
    while time.monotonic() < deadline:
        gw.embed(QUERY)
        gw.conn.request("GET", "/metrics")
        if inputs_by_tokenizer(gw.conn.getresponse().read().decode()).get("gateway", 0) > 0:
            return True
        time.sleep(0.1)
    return False


def _first_answer(port: int, deadline: float) -> int | None:
    """The gateway finds the model once the server is up: wait for its first answer, each try
    bounded; -> its port, or None (with the reason printed) if it never answered, so that the
    Triton figures of the run still come out."""
    error: Exception | None = None
    refusals = 0
    while time.monotonic() < deadline and refusals < 10:
        try:
            Gateway(port, timeout=10).embed([1, 2, 3])
            return port
        except OSError as e:  # not listening yet
            error = e
        except RuntimeError as e:  # it answered, with an error: a few tries, not two minutes of them
            error, refusals = e, refusals + 1
        time.sleep(0.2)
    print(f"the gateway did not answer /v1/embeddings ({error!r}): measuring without it", flush=True)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "minilm", "qwen3-tiny"])
    p.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--latency-n", type=int, default=200)
    p.add_argument("--concurrency-n", type=int, default=200)
    p.add_argument("--gateway-option", action="append", default=[], metavar="NAME=VALUE",
                   help="a GatewayOptions field for the measured gateway, e.g. gateway_workers=2 (repeatable)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/gateway.json")
    args = p.parse_args()
    gateway_options = gateway_option_values(args.gateway_option)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-gateway-"))
    folder = model_folder(args.model, workdir)
    windows = TokenWindows(load_model_spec(folder).tokenizer_file)
    quick = args.device == "cpu"
    res: dict = {"model": args.model, "device": args.device, "command": " ".join(sys.argv),
                 "gateway_options": gateway_options,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    # (no load shedding: the bulk suite queues more work than a CPU finishes in the default 10 s)
    with contextlib.ExitStack() as stack:
        opts, gw_port = stack.enter_context(pergola_stack(folder, workdir, args.device == "gpu", gateway_options,
                                                          max_queue_seconds=0.0))
        if gw_port is None:
            raise SystemExit("the gateway never answered: nothing to measure (its log is above)")
        url = f"127.0.0.1:{opts.grpc_port}"
        mod, client = grpc_client(url)
        gw = Gateway(gw_port)
        res["text_tokenized_in_gateway"] = tokenizes_texts(gw_port)
        ensemble_port = free_port()
        stack.callback(spawn_gateway([opts], ensemble_port, gateway_tokenize_chars=0).terminate)
        if _first_answer(ensemble_port, deadline=time.monotonic() + 120) is None:
            raise SystemExit("the second gateway never answered")
        check = windows.ids(128, 4, seed=1)
        direct, through = infer_tokens(client, mod, check), gw.embed([s.tolist() for s in check])
        res["max_abs_diff_gateway_vs_triton"] = float(np.abs(direct - through).max())
        print(f"gateway vs Triton, same ids: max |diff| {res['max_abs_diff_gateway_vs_triton']:.2e}", flush=True)

        ids = [[s] for s in windows.ids(128, 20, seed=128)]
        res["latency_128_tokens"] = time_paired({
            "triton_grpc": lambda x: infer_tokens(client, mod, x),
            "gateway": lambda x: gw.embed([x[0].tolist()]),
            # base64 answers: what the openai SDK asks for (decoding float JSON costs the client more)
            "gateway_base64": lambda x: gw.embed([x[0].tolist()], base64_out=True)}, ids, args.latency_n)
        via_ensemble = Gateway(ensemble_port)  # the same text through the `embed` ensemble's tokenizer
        res["latency_text_query"] = time_paired({
            "triton_grpc": lambda x: infer_text(client, mod, x),
            "gateway": lambda x: gw.embed(x[0]),
            "gateway_base64": lambda x: gw.embed(x[0], base64_out=True),
            "gateway_via_ensemble": lambda x: via_ensemble.embed(x[0])}, [[QUERY]], args.latency_n)
        for suite in ("latency_128_tokens", "latency_text_query"):
            row = res[suite]
            for name in [k for k in row if k.startswith("gateway")]:
                row[f"added_p50_ms_{name}"] = row[name]["p50"] - row["triton_grpc"]["p50"]
                print(f"  {suite}: Triton p50 {row['triton_grpc']['p50']:.3f} ms, {name} p50 "
                      f"{row[name]['p50']:.3f} ms ({row[f'added_p50_ms_{name}']:+.3f}), p99 {row[name]['p99']:.3f}",
                      flush=True)

        length = 128 if quick else 512
        requests = 2 if quick else 4
        res["throughput"] = {"length": length,
                             "triton_grpc": run_throughput(url, windows, length, requests_per_proc=requests),
                             "gateway": run_client_processes(_gateway_worker, (gw_port,), windows, length,
                                                             requests_per_proc=requests)}
        t = res["throughput"]
        t["ratio"] = t["gateway"]["embeddings_per_s"] / t["triton_grpc"]["embeddings_per_s"]
        print(f"  throughput 100 x {length}: Triton {t['triton_grpc']['embeddings_per_s']:.0f} emb/s, gateway "
              f"{t['gateway']['embeddings_per_s']:.0f} ({t['ratio']:.3f})", flush=True)

        texts = windows.texts(length, 64, seed=3)
        res["concurrency"] = {"length": length}
        for n in ([1, 4] if quick else [1, 4, 16]):
            row = res["concurrency"][n] = concurrency(gw_port, texts, n, 40 if quick else args.concurrency_n)
            print(f"  gateway, {n:2d} in flight: p50 {row['p50']:.2f} ms, {row['requests_per_s']:.0f} req/s", flush=True)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
