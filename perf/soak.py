"""Soak: steady traffic of varying shapes against a running server, sampling the resident memory
(RSS) of tritonserver and of every model's stub processes. Memory must stay flat: after a warm-up
(the first fifth of the run) no process may grow by more than --max-growth-mb (Triton's own
L0_memory_growth test allows 100 MB).

    python perf/soak.py --grpc localhost:8001 --repo model_repository --minutes 60 --out soak.json

tests/test_soak.py runs it for 10 minutes on the CPU against the test server.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))
sys.path.insert(0, str(ROOT / "python_models"))
from pergola.triton.supervisor import resident_bytes  # noqa: E402
from pergola_client import PergolaClient  # noqa: E402


def rss_mb(pid: int) -> float:
    return resident_bytes(pid) / 2**20


def server_processes(repo: Path) -> dict[str, list[int]]:
    """'tritonserver' and each model name -> pids (the stubs of a model with several instances)."""
    from pergola.triton.supervisor import stub_pids

    out = stub_pids(repo)
    flag = f"--model-repository={Path(repo).resolve()}".encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and flag in args:
            out.setdefault("tritonserver", []).append(int(cmdline.parent.name))
    return out


def sample(repo: Path) -> dict[str, float]:
    """Process name -> RSS in MB (a model's instances summed)."""
    return {name: sum(rss_mb(p) for p in pids) for name, pids in server_processes(repo).items()}


def error_kind(error: Exception) -> str:
    """What refused a request, for the record: the gRPC status (UNAVAILABLE: shed at the door,
    DEADLINE_EXCEEDED, ...) when the client gives one, else the exception's type."""
    status = getattr(error, "status", None)
    return str(status() if callable(status) else status or type(error).__name__)


def traffic(url: str, model: str, words: list[str], stop: threading.Event, seed: int, counts: dict,
            reasons: Counter, examples: dict[str, str]) -> None:
    """Requests of varying shape: 1-64 texts of 1-400 words, some at the length limit."""
    rng = random.Random(seed)
    with PergolaClient(url, model=model, timeout_s=60) as client:
        while not stop.is_set():
            n = rng.choice([1, 1, 2, 3, 8, 17, 32, 64])
            texts = [" ".join(rng.choices(words, k=rng.randint(1, 400))) for _ in range(n)]
            try:
                out = client.embed(texts, dimensions=rng.choice([None, None, 64]))
                assert out.shape[0] == n and np.isfinite(out).all()
                counts["ok"] += 1
            except AssertionError:
                counts["wrong"] += 1
            except Exception as e:  # noqa: BLE001 - refused under load: counted, not fatal
                counts["refused"] += 1
                kind = error_kind(e)
                reasons[kind] += 1
                examples.setdefault(kind, str(e)[:300])
                time.sleep(0.2)


def soak(url: str, repo: Path, model: str, minutes: float, clients: int, every_s: float,
         progress: bool = False) -> dict:
    sys.path.insert(0, str(ROOT / "perf"))
    from inputs import corpus_text

    words = corpus_text().split()
    stop = threading.Event()
    counts = {"ok": 0, "refused": 0, "wrong": 0}
    reasons: Counter = Counter()
    examples: dict[str, str] = {}  # the first message of each kind
    threads = [threading.Thread(target=traffic, args=(url, model, words, stop, i, counts, reasons, examples),
                                daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    samples = []
    while time.monotonic() - t0 < minutes * 60:
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": sample(repo), **counts})
        if progress:
            print(json.dumps(samples[-1]), flush=True)
        time.sleep(every_s)
    stop.set()
    for t in threads:
        t.join(timeout=90)
    time.sleep(every_s)  # idle: what is kept when nothing runs
    samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": sample(repo), "idle": True, **counts})
    return {"minutes": minutes, "clients": clients, "samples": samples, "growth_mb": growth(samples), **counts,
            "refused_by": dict(reasons), "refused_examples": examples}


def growth(samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per process: the most RSS in the fifth of the loaded samples after the warm-up (the first
    fifth), the most in the last fifth, the peak, idle at the end, and growth = last fifth's most
    - the warm-up's. Peaks against peaks: RSS under load swings by what is in flight (a request
    of 64 texts of 400 words holds its buffers while it runs), so one sample against the most of
    several would count a swing as growth; a leak raises the peaks."""
    loaded = [s for s in samples if not s.get("idle")]
    fifth = max(1, len(loaded) // 5)
    warm, tail = loaded[fifth:2 * fifth], loaded[-fifth:]
    out = {}
    for name in samples[-1]["rss_mb"]:
        after_warmup = max(s["rss_mb"].get(name, 0.0) for s in warm)
        late = max(s["rss_mb"].get(name, 0.0) for s in tail)
        out[name] = {"after_warmup": round(after_warmup, 1), "late": round(late, 1),
                     "peak": round(max(s["rss_mb"].get(name, 0.0) for s in samples), 1),
                     "idle": round(samples[-1]["rss_mb"][name], 1), "growth": round(late - after_warmup, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc", default="localhost:8001")
    p.add_argument("--repo", default="model_repository", help="the server's repository folder (to find its stubs)")
    p.add_argument("--model", default="embed")
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    p.add_argument("--max-growth-mb", type=float, default=100)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = soak(args.grpc, Path(args.repo), args.model, args.minutes, args.clients, args.every, progress=True)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    worst = max(g["growth"] for g in result["growth_mb"].values())
    raise SystemExit(0 if worst <= args.max_growth_mb and not result["wrong"] else 1)


if __name__ == "__main__":
    main()
