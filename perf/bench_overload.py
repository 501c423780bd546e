"""Overload: many clients mixing small and large requests, each with a deadline, against a
running server. Shows shedding by work (engine/loop.py): how soon the first refusal comes,
whether accepted requests finish within their deadline, and how soon a small request is served
normally once the flood ends.

    python perf/bench_overload.py --url localhost:8001 --clients 64 --seconds 30 --timeout 10

Outcomes per request: ok; refused (UNAVAILABLE at the door: retry); cancelled (the server
dropped it at its deadline); deadline (the client gave up first); error (anything else).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from pergola_client import PergolaClient  # noqa: E402


@dataclass
class Record:
    kind: str  # small | large
    start: float
    end: float
    outcome: str


def classify(error: Exception) -> str:
    text = str(error)
    if "DEADLINE_EXCEEDED" in text or "Deadline Exceeded" in text or "timed out" in text:
        return "deadline"
    if "UNAVAILABLE" in text and ("queued" in text or "timeout" in text or "retry" in text):
        return "refused"
    if "CANCELLED" in text or "cancelled" in text or "timeout passed" in text:
        return "cancelled"
    return "error"


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def flood(url: str, small: list[str], large: list[str], clients: int, seconds: float, large_fraction: float,
          timeout_s: float, model: str = "embed") -> dict:
    """Run the flood; return the summary (seconds relative to the flood's start or end)."""
    records: list[Record] = []
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with PergolaClient(url, model=model, timeout_s=timeout_s) as c:
            while not stop.is_set():
                kind = "large" if rng.random() < large_fraction else "small"
                texts = large if kind == "large" else small
                start = time.monotonic()
                try:
                    c.embed(texts)
                    outcome = "ok"
                except Exception as e:  # noqa: BLE001 - every outcome is recorded
                    outcome = classify(e)
                    if outcome == "error":
                        print(f"unexpected error: {str(e)[:300]}", file=sys.stderr)
                    time.sleep(0.05)  # a refused client retries after a short back-off
                with lock:
                    records.append(Record(kind, start - t0, time.monotonic() - t0, outcome))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    ended = time.monotonic()
    recovery = None
    with PergolaClient(url, model=model, timeout_s=max(timeout_s, 30)) as probe:
        while time.monotonic() - ended < 120:
            try:
                probe.embed(small)
                recovery = time.monotonic() - ended
                break
            except Exception:  # noqa: BLE001 - still shedding or draining
                time.sleep(0.2)
    for t in threads:
        t.join(timeout=timeout_s + 30)
    return summarize(records, seconds, recovery, clients, timeout_s)


def summarize(records: list[Record], seconds: float, recovery: float | None, clients: int,
              timeout_s: float) -> dict:
    outcomes = {o: sum(r.outcome == o for r in records) for o in ("ok", "refused", "cancelled", "deadline", "error")}
    refusals = [r for r in records if r.outcome == "refused"]
    latency = {kind: {"p50_s": percentile([r.end - r.start for r in records if r.kind == kind and r.outcome == "ok"], 50),
                      "p99_s": percentile([r.end - r.start for r in records if r.kind == kind and r.outcome == "ok"], 99),
                      "ok": sum(r.kind == kind and r.outcome == "ok" for r in records)}
               for kind in ("small", "large")}
    return {
        "clients": clients, "seconds": seconds, "timeout_s": timeout_s, "outcomes": outcomes,
        "first_refusal_s": min((r.end for r in refusals), default=None),
        "refusal_p99_s": percentile([r.end - r.start for r in refusals], 99),
        "accepted_latency": latency, "recovery_s": recovery,
        "records": [asdict(r) for r in records],
    }


def prose(count: int, words: int, seed: int = 0) -> list[str]:
    """`count` distinct texts of `words` words from the Python documentation (perf/inputs.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inputs import corpus_text

    tokens = corpus_text().split()
    starts = np.random.default_rng(seed).integers(0, len(tokens) - words, size=count)
    return [" ".join(tokens[s:s + words]) for s in starts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    p.add_argument("--model", default="embed")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--timeout", type=float, default=10, help="each request's deadline (s), sent to the server")
    p.add_argument("--large-fraction", type=float, default=0.5)
    p.add_argument("--large-texts", type=int, default=100, help="texts in a large request")
    p.add_argument("--words", type=int, default=300, help="words per large-request text")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    args = p.parse_args()
    small = ["what is a pergola?"]
    large = prose(args.large_texts, args.words)
    summary = flood(args.url, small, large, args.clients, args.seconds, args.large_fraction, args.timeout,
                    args.model)
    brief = {k: v for k, v in summary.items() if k != "records"}
    print(json.dumps(brief, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
