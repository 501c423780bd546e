"""Overload through the gateway: what refused, accepted and abandoned requests cost, on `pergola serve`.

    python perf/bench_gateway_overload.py --out perf/results/DATE-COMMIT [--clients 64,128,256]
        [--seconds 30] [--serve-args "--device cpu"]

Starts `pergola serve` (the default model, MiniLM; tritonserver + the gateway) on free ports, then:

  solo        one client sending 32 x 200-word texts back to back (--solo-seconds): the useful
              output (texts answered per second) the floods are compared with
  flood N     N clients (asyncio, one keep-alive connection each) sending the same for --seconds,
              each honouring Retry-After as the OpenAI SDK does (--backoff S: ignore it, retry
              after S seconds, as a careless client): refusal latency p50 / p99, accepted latency
              p50 / p99 against the queue bound, 504 share of the accepted, useful output against
              solo, and the encoder's tokens computed for requests that were not answered (its
              pergola_tokens_total against the answers' usage.prompt_tokens)
  leave       24 token ids x 256 in the encoder, then 4 clients sending 32 x 200-word texts and
              leaving after 1 s, 5 times: tokens computed for them (the counter's rise less the
              ids'); and one client alone leaving after 1 s mid-compute: tokens computed for it and
              how long the encoder kept computing after it left
  big         1,024 texts of 200 words on the idle server: status and time (413 naming
              --request-timeout-s when it cannot finish in time; with --big-timeout the gateway is
              restarted with that request timeout and the request answered)

Writes gateway_overload.json (every phase's summary) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overload import prose  # noqa: E402

KEY = "bench-overload-key"
TEXTS, WORDS = 32, 200


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


class Serve:
    """`pergola serve` on free ports, ended with the benchmark."""

    def __init__(self, workdir: Path, args: list[str], cpus: str | None = None) -> None:
        from pergola.triton.server import free_ports

        self.http, self.grpc, self.metrics, self.gateway = free_ports(4)
        self.url = f"http://127.0.0.1:{self.gateway}"
        self.log = workdir / "serve.log"
        pinned = ["taskset", "-c", cpus] if cpus else []  # (a 2-core host's share on a larger one)
        self.proc = subprocess.Popen(
            [*pinned, sys.executable, "-m", "pergola.cli", "serve", "--repo", str(workdir / "repo"), "--http-port",
             str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--gateway-port",
             str(self.gateway), "--gateway-bind", "127.0.0.1", "--api-key", KEY, *args],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

    def ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if post_sync(self.url, ["ready?"])[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"pergola serve did not answer within {timeout_s:g} s: {self.log}")

    def tokens(self) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10).read().decode()
        return sum(float(v) for v in re.findall(r'^pergola_tokens_total\{model="[^"]*_encoder"\} (\S+)$', text, re.M))

    def settled(self, quiet_s: float = 3.0) -> tuple[float, float]:
        """(the encoder's token counter once it stopped moving for `quiet_s`, when it last moved)."""
        value, since = self.tokens(), time.monotonic()
        while time.monotonic() - since < quiet_s:
            time.sleep(0.2)
            now = self.tokens()
            if now != value:
                value, since = now, time.monotonic()
        return value, since

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def post_sync(url: str, inputs: list, timeout_s: float = 600) -> tuple[int, dict]:
    data = json.dumps({"model": "embed", "input": inputs}).encode()
    req = urllib.request.Request(f"{url}/v1/embeddings", data=data, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def body_of(inputs: list) -> bytes:
    return json.dumps({"model": "embed", "input": inputs}).encode()


async def one_call(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, int, float | None]:
    """-> (status, tokens answered, Retry-After)."""
    async with session.post(f"{url}/v1/embeddings", data=body, headers={"Content-Type": "application/json",
                                                                         "Authorization": f"Bearer {KEY}"}) as r:
        payload = await r.read()
        tokens = json.loads(payload)["usage"]["prompt_tokens"] if r.status == 200 else 0
        retry = r.headers.get("Retry-After")
        return r.status, tokens, float(retry) if retry is not None else None


async def clients(url: str, body: bytes, count: int, seconds: float, backoff: float | None) -> list[dict]:
    """`count` clients sending `body` for `seconds` -> one record per request."""
    records: list[dict] = []
    stop = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client(seed: int) -> None:
            await asyncio.sleep(random.Random(seed).random() * 0.5)  # (not all in the same millisecond)
            while time.monotonic() < stop:
                t0 = time.monotonic()
                try:
                    status, tokens, retry = await one_call(session, url, body)
                except (TimeoutError, aiohttp.ClientError) as e:
                    status, tokens, retry = -1, 0, None
                    print(f"client error: {e!r}", file=sys.stderr)
                records.append({"start": t0, "end": time.monotonic(), "status": status, "tokens": tokens,
                                "retry_after": retry})
                if status != 200:
                    await asyncio.sleep(backoff if backoff is not None else (retry or 1.0))

        await asyncio.gather(*(client(i) for i in range(count)))
    return records


def summarize(records: list[dict], texts: int, bound_s: float, solo: float | None, wasted: float,
              seconds: float) -> dict:
    ok = [r for r in records if r["status"] == 200]
    refused = [r for r in records if r["status"] == 429]
    late = [r for r in records if r["status"] == 504]
    t0 = min((r["start"] for r in records), default=0.0)
    span = max((r["end"] for r in ok), default=t0 + seconds) - t0
    useful = len(ok) * texts / span if span > 0 else 0.0
    statuses: dict[str, int] = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    latency = [r["end"] - r["start"] for r in ok]
    return {
        "requests": len(records), "statuses": statuses,
        "refusal_p50_ms": percentile([1e3 * (r["end"] - r["start"]) for r in refused], 50),
        "refusal_p99_ms": percentile([1e3 * (r["end"] - r["start"]) for r in refused], 99),
        "retry_after_p50_s": percentile([r["retry_after"] for r in refused if r["retry_after"]], 50),
        "accepted_p50_s": percentile(latency, 50), "accepted_p99_s": percentile(latency, 99),
        "accepted_max_s": round(max(latency), 3) if latency else None, "queue_bound_s": bound_s,
        "share_504": round(len(late) / max(1, len(ok) + len(late)), 4),
        "useful_texts_per_s": round(useful, 2),
        "useful_vs_solo": round(useful / solo, 3) if solo else None,
        "tokens_computed_not_answered": wasted,
    }


def flood(serve: Serve, texts: list[str], count: int, seconds: float, backoff: float | None, bound_s: float,
          solo: float | None) -> dict:
    before, _ = serve.settled()
    records = asyncio.run(clients(serve.url, body_of(texts), count, seconds, backoff))
    after, _ = serve.settled()
    answered = sum(r["tokens"] for r in records)
    summary = summarize(records, len(texts), bound_s, solo, after - before - answered, seconds)
    summary |= {"clients": count, "seconds": seconds, "backoff": backoff if backoff is not None else "Retry-After"}
    print(json.dumps(summary), flush=True)
    return summary


async def leave_after(url: str, body: bytes, after_s: float) -> None:
    """Send `body` and drop the connection after `after_s`, unanswered."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=after_s)) as session:
        try:
            await one_call(session, url, body)
        except TimeoutError:
            pass


def leave(serve: Serve, texts: list[str], rounds: int = 5, leavers: int = 4) -> dict:
    """Clients that leave: behind 6,144 token ids (queued), and alone (mid-compute)."""
    held_ids = [[101, *range(1000, 1254), 102] for _ in range(24)]
    queued = []
    for _ in range(rounds):
        before, _ = serve.settled()

        async def round_() -> int:
            async with aiohttp.ClientSession() as session:
                held = asyncio.create_task(one_call(session, serve.url, body_of(held_ids)))
                await asyncio.sleep(0.3)
                await asyncio.gather(*(leave_after(serve.url, body_of(texts), 1.0) for _ in range(leavers)))
                status, tokens, _ = await held
                return tokens if status == 200 else 0

        held_tokens = asyncio.run(round_())
        after, _ = serve.settled()
        queued.append(after - before - held_tokens)
    before, _ = serve.settled()
    asyncio.run(leave_after(serve.url, body_of(texts), 1.0))
    left_at = time.monotonic()
    after, moved_at = serve.settled()
    out = {"queued_leavers": leavers * rounds, "tokens_computed_for_queued_leavers": sum(queued),
           "alone_tokens_computed": after - before, "alone_request_tokens": len(texts) * 256,
           "alone_encoder_busy_after_leaving_s": round(max(0.0, moved_at - left_at), 2)}
    print(json.dumps(out), flush=True)
    return out


def big(serve: Serve) -> dict:
    t0 = time.monotonic()
    status, body = post_sync(serve.url, prose(1024, WORDS, seed=9))
    out = {"status": status, "seconds": round(time.monotonic() - t0, 2),
           "message": body.get("error", {}).get("message") if status != 200 else None,
           "texts_answered": len(body.get("data", []))}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--clients", default="64,128,256")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--solo-seconds", type=float, default=20)
    p.add_argument("--backoff", type=float, default=None, help="ignore Retry-After, retry after this many s")
    p.add_argument("--bound", type=float, default=10.0, help="the queue bound in force (reported beside p99)")
    p.add_argument("--serve-args", default="", help="more `pergola serve` arguments")
    p.add_argument("--cpus", default=None, help="run `pergola serve` on these CPUs only (taskset -c LIST)")
    p.add_argument("--big-timeout", type=float, default=None, help="also answer the 1,024-text request with this "
                                                                    "--request-timeout-s")
    p.add_argument("--phases", default="solo,flood,leave,big")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = set(args.phases.split(","))
    texts = prose(TEXTS, WORDS, seed=1)
    result: dict = {"command": " ".join(sys.argv), "host_cpus": os.cpu_count(), "serve_cpus": args.cpus,
                    "texts": TEXTS, "words": WORDS}
    workdir = Path(tempfile.mkdtemp(prefix="bench-gw-overload-"))
    serve = Serve(workdir, shlex.split(args.serve_args), args.cpus)
    try:
        serve.ready()
        post_sync(serve.url, texts)  # the gateway measures a throughput
        solo = None
        if "solo" in phases:
            records = asyncio.run(clients(serve.url, body_of(texts), 1, args.solo_seconds, None))
            result["solo"] = summarize(records, TEXTS, args.bound, None, 0.0, args.solo_seconds)
            solo = result["solo"]["useful_texts_per_s"]
            print(json.dumps(result["solo"]), flush=True)
        if "flood" in phases:
            result["floods"] = [flood(serve, texts, int(n), args.seconds, args.backoff, args.bound, solo)
                                for n in args.clients.split(",")]
        if "leave" in phases:
            result["leave"] = leave(serve, texts)
        if "big" in phases:
            result["big"] = big(serve)
    finally:
        serve.stop()
    if args.big_timeout and "big" in phases:
        serve = Serve(workdir, [*shlex.split(args.serve_args), "--request-timeout-s", str(args.big_timeout)],
                      args.cpus)
        try:
            serve.ready()
            post_sync(serve.url, texts)
            result["big_with_timeout"] = big(serve) | {"request_timeout_s": args.big_timeout}
        finally:
            serve.stop()
    (out / "gateway_overload.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
