"""The gateway's own CPU work under heavy requests: an 8-word text query's latency through the
gateway while bulk requests go through the same gateway (its event loop is shared by both).

    python perf/bench_gateway_bulk.py --out perf/out/gateway_bulk.json
    PYTHONPATH=<an older checkout>/python_models:... python perf/bench_gateway_bulk.py ...   # older code

One tritonserver (qwen3-tiny, CPU: the catalog, the tokenizer instances) and the gateway as
`pergola serve` starts it (reading the repository), in a process of its own whose calls to
NAME_encoder are answered inside it after --encoder-ms with a fixed [n, --dim] float32 answer:
the GPU's share, so that what is timed is the gateway's CPU, whatever the host (--real-encoder:
Triton's encoder answers). Loads, each on perf/mixed.py's timeline (idle queries, bulk
started, queries under it, bulk alone, idle again):
  ids_100x512   4 processes, each sending 100 x 512 token ids to /v1/embeddings, float answers
  embed_max     1 process, the largest body /v1/embeddings takes by default: 1,024 x 5,000 ids
                (~30 MB of JSON), its answer 1,024 x --dim floats
  tokenize_max  1 process, /tokenize of one 1,000,000-character text (the default
                --max-tokenize-chars; prose and code, ~250k tokens, a ~16 MB answer)
The query, sequential: an 8-word text to /v1/embeddings, tokenized in the gateway. The goal
(issue 38): under ids_100x512 the query's p99 within 3x its idle p99; a maximal request adds
< 100 ms to it. Then `memory`: the resident memory of the gateway (with its CPU workers) and of
the tokenizer instances, before and after 4 maximal /tokenize requests through this gateway, then
4 through a second one that does not read the repository (Triton's tokenizer tokenizes), then one
small request.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

# (only light imports here: the gateway runs as this script (--serve), and its CPU workers, spawned,
# import it again; the benchmark's own modules, torch among them, are imported by main())
PERF = str(Path(__file__).resolve().parent)
NAME = "bench"  # the served model (bench_server.NAME)
LOADS = ("ids_100x512", "embed_max", "tokenize_max")


class Bulk:
    """One bulk request, its JSON built once: `len()` is its inputs (mixed.py counts them);
    `warm` the small request mixed.py warms the connection with (as batch[:2])."""

    def __init__(self, path: str, body: bytes, count: int, warm: Bulk | None = None) -> None:
        self.path, self.body, self.count, self.warm = path, body, count, warm

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, _: slice) -> Bulk:
        return self.warm or self


def bulk_sender(port: int):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def send(request: Bulk) -> None:
        for attempt in range(2):  # (a keep-alive connection idle past the gateway's timeout: reconnect once)
            try:
                conn.request("POST", request.path, request.body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                if attempt:
                    raise
        answer = response.read()
        if response.status != 200:
            raise RuntimeError(f"{request.path} answered {response.status}: {answer[:300]!r}")
    return send


def query(port: int):
    from bench_gateway import Gateway
    from mixed import QUERY

    gw = Gateway(port)
    return lambda: gw.embed([QUERY])


def requests(load: str, windows) -> list[list[Bulk]]:
    """Each bulk process's requests for `load` (windows: inputs.TokenWindows)."""
    from inputs import corpus_text

    def ids_body(seqs: list[np.ndarray]) -> bytes:
        return json.dumps({"model": NAME, "input": [s.tolist() for s in seqs]}, separators=(",", ":")).encode()

    small = Bulk("/v1/embeddings", ids_body([np.arange(1, 9)]), 1)
    if load == "ids_100x512":
        return [[Bulk("/v1/embeddings", ids_body(windows.ids(512, 100, seed=10_000 * p + i)), 100) for i in range(3)]
                for p in range(4)]
    if load == "embed_max":
        return [[Bulk("/v1/embeddings", ids_body(windows.ids(5_000, 1_024, seed=7)), 1_024, small)]]
    text = (corpus_text() * 2)[:1_000_000]  # (windows unused)
    return [[Bulk("/tokenize", json.dumps({"model": NAME, "inputs": text}).encode(), 1, small)]]


def rss_mb(pids: list[int]) -> float:
    """Resident memory of `pids` together, MB."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def with_children(pid: int) -> list[int]:
    """`pid` and its children (the gateway and its CPU workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [pid, *map(int, children.read_text().split())] if children.exists() else [pid]


def tokenizer_stubs(repo: Path) -> list[int]:
    """The Python-backend stub processes of NAME_tokenizer in `repo`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"triton_python_backend_stub" in cmd and f"{repo}/{NAME}_tokenizer".encode() in cmd:
            found.append(int(proc.name))
    return found


def memory(port: int, gw_pid: int, repo: Path, start_gateway) -> dict:
    """RSS before and after maximal /tokenize requests, through the gateway and through Triton."""
    send = bulk_sender(port)
    big = requests("tokenize_max", None)[0][0]
    small = Bulk("/tokenize", json.dumps({"model": NAME, "inputs": "a short text"}).encode(), 1)
    out = {"before": {"gateway_mb": rss_mb(with_children(gw_pid)), "tokenizers_mb": rss_mb(tokenizer_stubs(repo))}}
    for _ in range(4):
        send(big)
    out["after_4_via_gateway"] = {"gateway_mb": rss_mb(with_children(gw_pid)),
                                  "tokenizers_mb": rss_mb(tokenizer_stubs(repo))}
    other_port, other = start_gateway()
    try:
        send_other = bulk_sender(other_port)
        for _ in range(4):
            send_other(big)
        out["after_4_via_triton"] = {"tokenizers_mb": rss_mb(tokenizer_stubs(repo))}
        send_other(small)
        out["after_a_small_one"] = {"tokenizers_mb": rss_mb(tokenizer_stubs(repo))}
    finally:
        other.terminate()
    return out


def serve(port: int, grpc_url: str, http_port: str, repo: str, encoder_ms: float, dim: int) -> None:
    """The gateway (this script as a child process), its encoder calls answered here unless
    encoder_ms < 0."""
    from pergola.gateway import app
    from pergola.gateway.backend import Backend
    from pergola.gateway.options import GatewayOptions

    if encoder_ms >= 0:
        real = Backend._infer

        class Answer:
            def __init__(self, n: int) -> None:
                self.vectors = np.ones((n, dim), np.float32)

            def as_numpy(self, name: str) -> np.ndarray:
                return self.vectors

        async def infer(self, model, inputs, outputs, version=""):
            if not model.endswith("_encoder"):
                return await real(self, model, inputs, outputs, version)
            await asyncio.sleep(encoder_ms / 1e3)
            return Answer(next(i.array.shape[-1] for i in inputs if i.name == "LENGTHS"))
        Backend._infer = infer
    app.run(GatewayOptions(triton=grpc_url, triton_http_port=http_port, gateway_port=port, gateway_bind="127.0.0.1",
                           models=NAME, triton_repository=repo or None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("-n", type=int, default=300, help="queries under each load")
    p.add_argument("--heavy-s", type=float, default=30.0,
                   help="embed_max and tokenize_max: queries for at least this long (their requests take seconds)")
    p.add_argument("--encoder-ms", type=float, default=2.0, help="the stubbed encoder's time per call")
    p.add_argument("--dim", type=int, default=1024, help="the stubbed encoder's embedding size")
    p.add_argument("--real-encoder", action="store_true", help="Triton's encoder answers (no stub)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory phase")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/gateway_bulk.json")
    p.add_argument("--serve", nargs=5, metavar=("PORT", "GRPC", "HTTP_PORT", "REPO", "ENCODER_MS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        port, grpc_url, http_port, repo, encoder_ms = args.serve
        return serve(int(port), grpc_url, http_port, repo, float(encoder_ms), args.dim)
    import subprocess

    sys.path.insert(0, PERF)
    import mixed
    import pergola
    from bench_gateway import _first_answer, tokenizes_texts, triton_servers
    from common import model_folder, write_result
    from inputs import TokenWindows
    from pergola.config.hf_folder import load_model_spec
    from pergola.triton.server import free_port

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-gateway-bulk-"))
    folder = model_folder("qwen3-tiny", workdir)
    windows = TokenWindows(load_model_spec(folder).tokenizer_file)
    encoder_ms = -1.0 if args.real_encoder else args.encoder_ms
    res: dict = {"command": " ".join(sys.argv), "pergola": str(Path(pergola.__file__).parent),
                 "encoder": "triton" if args.real_encoder else f"stub {args.encoder_ms} ms, dim {args.dim}",
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loads": {}}
    with triton_servers(folder, workdir, False, [None], max_queue_seconds=0.0) as (opts,):
        def start_gateway(repo: str = str(opts.repo)) -> tuple[int, subprocess.Popen]:
            port = free_port()
            return port, subprocess.Popen([sys.executable, __file__, "--dim", str(args.dim), "--serve", str(port),
                                           f"127.0.0.1:{opts.grpc_port}", str(opts.http_port), repo, str(encoder_ms)])

        def plain_gateway() -> tuple[int, subprocess.Popen]:
            port, proc = start_gateway("")
            if _first_answer(port, time.monotonic() + 120) is None:
                raise SystemExit("the second gateway did not answer")
            return port, proc

        port, gw = start_gateway()
        try:
            if _first_answer(port, time.monotonic() + 120) is None or not tokenizes_texts(port):
                raise SystemExit("the gateway did not answer, or never tokenized a query itself")
            kinds = {"gateway_text": partial(query, port)}
            res["idle"] = mixed.idle_latency(kinds, args.n)
            print(f"idle: p50 {res['idle']['gateway_text']['p50']:.2f} p99 {res['idle']['gateway_text']['p99']:.2f} ms",
                  flush=True)
            for load in args.loads:
                print(f"{load}:", flush=True)
                heavy = load != "ids_100x512"
                row = res["loads"][load] = mixed.run_load(
                    kinds, bulk_sender, (port,), requests(load, windows), n=args.n,
                    loaded_s=args.heavy_s if heavy else None, alone_s=args.heavy_s / 2 if heavy else 5.0)
                row["p99_added_ms"] = row["loaded"]["gateway_text"]["p99"] - row["idle"]["gateway_text"]["p99"]
                row["p99_ratio"] = row["loaded"]["gateway_text"]["p99"] / row["idle"]["gateway_text"]["p99"]
                print(f"  p99 {row['p99_ratio']:.2f}x idle (+{row['p99_added_ms']:.1f} ms)", flush=True)
            if not args.no_memory:
                res["memory"] = memory(port, gw.pid, Path(opts.repo), plain_gateway)
                print(f"memory: {res['memory']}", flush=True)
        finally:
            gw.terminate()
            gw.wait(timeout=30)
    write_result(res, args.out)


if __name__ == "__main__":
    main()
