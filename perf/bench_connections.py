"""The gateway's door under a connection flood: a normal query's latency while thousands of idle
and slowloris connections are held, and how soon the gateway closes them.

    python perf/bench_connections.py --serve --out perf/results/DATE-COMMIT/connections.json
    python perf/bench_connections.py --url http://127.0.0.1:8080 [--twin http://127.0.0.1:8081]

  probe      a small query (/v1/embeddings, one short text), back to back over one keep-alive
             connection per door, the doors taking turns in blocks of 10: the flooded gateway and
             a twin gateway in front of the same Triton that no flood reaches (paired under the same
             drift of a shared host's speed); before, during and after the flood
  flood      --idle connections that send nothing and --slowloris connections that trickle a
             request's headers one byte every --trickle-s, from --procs processes (each from its
             own loopback address, its open-files limit raised to the hard one, at --flood-nice);
             every connection the gateway closes is opened again at once, as an attacker would
  closing    each flood connection's life from its opening (as the client sees it: the
             handshake done, maybe still in the gateway's accept queue) to the gateway's close:
             p50 / p99 / max; the header clock is --header-timeout-s (10 s by default), and one
             closed sooner made room under --max-connections
The flooded gateway's open files, CPU seconds and memory are read from its /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

QUERY = json.dumps({"model": "embed", "input": "what is a pergola?"})


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": int(a.size)}


def raise_open_files() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# -- the flood (one process each) -----------------------------------------------------------------

async def hold(host: str, port: int, source: str, slow: bool, trickle_s: float, lives: list[float],
               counts: Any, failures: list[str]) -> None:
    """One connection held open, opened again whenever the gateway closes it; each life recorded
    (a slowloris one's to within trickle_s: it looks for the close between its bytes)."""
    request = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
    slot = 1 if slow else 0
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, local_addr=(source, 0)), timeout=10)
        except (TimeoutError, OSError) as e:
            failures.append(type(e).__name__)
            await asyncio.sleep(0.5)
            continue
        opened = time.monotonic()
        counts[slot] += 1
        try:
            if slow:
                for sent in range(len(request)):
                    await asyncio.sleep(trickle_s)
                    if reader.at_eof():
                        break
                    writer.write(request[sent:sent + 1])
            else:
                while await reader.read(65536):
                    pass
        except OSError:
            pass
        finally:
            counts[slot] -= 1
            writer.close()
        lives.append(time.monotonic() - opened)


def flood_process(host: str, port: int, source: str, idle: int, slow: int, trickle_s: float, nice: int,
                  cpus: set[int] | None, stop_at: Any, counts: Any, out: Any) -> None:
    raise_open_files()
    os.nice(nice)  # (an attacker's CPU is not the server's; on one host the flood can yield some of it)
    if cpus:  # ...or, on a host with cores to spare, run apart from the server (--flood-cpus)
        os.sched_setaffinity(0, cpus)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        lives: dict[str, list[float]] = {"idle": [], "slowloris": []}
        failures: list[str] = []
        tasks = []
        every = (idle + slow) // max(slow, 1)
        for i in range(idle + slow):  # opened in steps of 200 (a burst of thousands overflows the backlog)
            kind = "slowloris" if slow and i % every == 0 and i // every < slow else "idle"
            tasks.append(asyncio.create_task(hold(host, port, source, kind == "slowloris", trickle_s,
                                                  lives[kind], counts, failures)))
            if i % 200 == 199:
                await asyncio.sleep(0.05)
        while not stop_at.value:
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=15)
        out.put({"lives": lives, "connect_failures": len(failures),
                 "failure_kinds": sorted(set(failures))})

    asyncio.run(main())


class Flood:
    def __init__(self, host: str, port: int, idle: int, slow: int, procs: int, trickle_s: float,
                 nice: int, cpus: set[int] | None = None) -> None:
        self.stop_at = mp.Value("b", 0)
        self.out: mp.Queue = mp.Queue()
        self.counts = [mp.Array("i", 2) for _ in range(procs)]
        self.procs = [mp.Process(target=flood_process, daemon=True,
                                 args=(host, port, f"127.0.0.{2 + k}", idle // procs + (k < idle % procs),
                                       slow // procs + (k < slow % procs), trickle_s, nice, cpus, self.stop_at,
                                       self.counts[k], self.out))
                      for k in range(procs)]
        for p in self.procs:
            p.start()

    def held(self) -> tuple[int, int]:
        return sum(c[0] for c in self.counts), sum(c[1] for c in self.counts)

    def end(self) -> dict[str, Any]:
        self.stop_at.value = 1
        parts = [self.out.get(timeout=120) for _ in self.procs]
        for p in self.procs:
            p.join(timeout=30)
        lives = {k: [x for part in parts for x in part["lives"][k]] for k in ("idle", "slowloris")}
        return {"lives_s": {k: percentiles(v) for k, v in lives.items()},
                "connect_failures": sum(p["connect_failures"] for p in parts),
                "failure_kinds": sorted({k for p in parts for k in p["failure_kinds"]})}


# -- the normal client ---------------------------------------------------------------------------

class Door:
    """One keep-alive connection to a gateway (opened again when it is closed)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.conn = http.client.HTTPConnection(host, port, timeout=60)
        self.ms: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []

    def query(self) -> None:
        started = time.perf_counter()
        try:
            self.conn.request("POST", "/v1/embeddings", QUERY, {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            r.read()
            self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
            if r.status == 200:
                self.ms.append((time.perf_counter() - started) * 1e3)
        except (OSError, http.client.HTTPException) as e:
            self.errors.append(type(e).__name__)
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def summary(self) -> dict[str, Any]:
        self.conn.close()
        return {"ms": percentiles(self.ms), "statuses": self.statuses, "errors": len(self.errors),
                "error_kinds": sorted(set(self.errors))}


def probe(doors: dict[str, tuple[str, int]], seconds: float, block: int = 10) -> dict[str, Any]:
    """Each door's latency, the doors taking turns in blocks of `block` queries for `seconds`."""
    opened = {name: Door(*address) for name, address in doors.items()}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for door in opened.values():
            for _ in range(block):
                door.query()
    return {name: door.summary() for name, door in opened.items()}


PROCESS_METRICS = ("process_open_fds", "process_cpu_seconds_total", "process_resident_memory_bytes")


def gateway_process(base: str) -> dict[str, float]:
    """The gateway process's open files, CPU seconds and resident bytes (its /metrics)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    found = {name: re.search(rf"^{name} ([0-9.e+]+)$", text, re.M) for name in PROCESS_METRICS}
    return {name: float(m.group(1)) for name, m in found.items() if m}


def gateway_capacity(base: str) -> int | None:
    """The connections the gateway holds at most, all its workers together (TEI's /info field
    max_concurrent_requests: --max-connections times --gateway-workers). A flood above it is not held
    whole: each new connection closes an idle one (gateway/connections.py), which the flood opens again."""
    try:
        with urllib.request.urlopen(f"{base}/info", timeout=30) as r:
            return json.loads(r.read()).get("max_concurrent_requests")
    except (OSError, ValueError):
        return None


def timed_probe(base: str, doors: dict[str, tuple[str, int]], seconds: float) -> dict[str, Any]:
    """probe(), with the flooded gateway's CPU use over it (CPU seconds a second) and its state after."""
    before = gateway_process(base)
    started = time.monotonic()
    out = probe(doors, seconds)
    after = gateway_process(base)
    if "process_cpu_seconds_total" in before and "process_cpu_seconds_total" in after:
        out["gateway_cpu_per_s"] = (after["process_cpu_seconds_total"] - before["process_cpu_seconds_total"]) \
            / (time.monotonic() - started)
    out["gateway_after"] = after
    return out


def sample(base: str, flood: Flood, stop: threading.Event, into: list[dict[str, Any]]) -> None:
    started = time.monotonic()
    while not stop.wait(2.0):
        idle, slow = flood.held()
        into.append({"t": round(time.monotonic() - started, 1), "idle_held": idle, "slowloris_held": slow,
                     "gateway_open_fds": gateway_process(base).get("process_open_fds")})


# -- a server of our own (--serve) ---------------------------------------------------------------

def start_serve(workdir: Path, extra: list[str]) -> tuple[list[subprocess.Popen], int, int]:
    """`pergola serve --device cpu` and a twin `pergola gateway` in front of the same Triton, as
    `pergola serve` starts its own; (processes, flooded gateway's port, twin's port)."""
    from pergola.triton.server import free_ports

    http_port, grpc, metrics, port, twin = free_ports(5)
    repo = workdir / "repo"
    serve = subprocess.Popen([sys.executable, "-m", "pergola.cli", "serve", "--device", "cpu", "--repo", str(repo),
                              "--http-port", str(http_port), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                              "--gateway-port", str(port), *extra],
                             stdout=open(workdir / "serve.log", "wb"), stderr=subprocess.STDOUT)
    procs = [serve]
    try:
        wait_answer(port, serve, workdir / "serve.log")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pergola.cli", "gateway", "--triton", f"127.0.0.1:{grpc}",
             "--triton-http-port", str(http_port), "--triton-metrics-port", str(metrics),
             "--triton-repository", str(repo), "--triton-admin-token-file", str(repo / ".admin-token"),
             "--gateway-port", str(twin), "--gateway-bind", "127.0.0.1"],
            stdout=open(workdir / "twin.log", "wb"), stderr=subprocess.STDOUT))
        wait_answer(twin, procs[-1], workdir / "twin.log")
    except BaseException:
        stop_all(procs)
        raise
    return procs, port, twin


def wait_answer(port: int, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"exited before answering: {log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/embeddings", QUERY, {"Content-Type": "application/json"})
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"no answer in {timeout:.0f} s: {log.read_text()[-3000:]}")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def address(url: str) -> tuple[str, int]:
    host, port = re.fullmatch(r"http://([^:/]+):(\d+)/?", url).groups()
    return host, int(port)


def cpu_list(text: str) -> set[int]:
    """'8-15' or '8,9,12-13' -> {8, ..., 15}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running gateway to flood, http://HOST:PORT")
    p.add_argument("--twin", default=None, help="with --url: a second gateway to the same Triton, not flooded")
    p.add_argument("--serve", action="store_true", help="start `pergola serve --device cpu` (MiniLM) and a twin gateway")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `pergola serve` argument")
    p.add_argument("--idle", type=int, default=20_000)
    p.add_argument("--slowloris", type=int, default=1_000)
    p.add_argument("--procs", type=int, default=4, help="flood processes (each below its open-files limit)")
    p.add_argument("--flood-nice", type=int, default=10, help="the flood processes' niceness: on one host, how "
                                                               "much CPU the attacker takes from the server")
    p.add_argument("--flood-cpus", type=cpu_list, default=None,
                   help="run the flood processes on these CPUs only, e.g. 8-15 (start the benchmark under "
                        "`taskset -c 0-7` so the servers keep the others)")
    p.add_argument("--trickle-s", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=30.0, help="each probe's length")
    p.add_argument("--ramp-s", type=float, default=20.0, help="flood time before the probe starts")
    p.add_argument("--header-timeout-s", type=float, default=10.0, help="the gateway's (the wait after the flood)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    hard = raise_open_files()
    res: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                           "open_files_hard_limit": hard, "idle": args.idle, "slowloris": args.slowloris,
                           "procs": args.procs, "flood_nice": args.flood_nice, "trickle_s": args.trickle_s,
                           "flood_cpus": sorted(args.flood_cpus or []), "own_cpus": sorted(os.sched_getaffinity(0))}
    per_proc = (args.idle + args.slowloris) / args.procs
    if per_proc > hard - 100:
        raise SystemExit(f"{per_proc:.0f} connections a process is over the open-files limit {hard}: raise --procs")
    procs: list[subprocess.Popen] = []
    if args.serve:
        procs, port, twin = start_serve(Path(tempfile.mkdtemp(prefix="pergola-conn-")), args.serve_arg)
        doors = {"flooded": ("127.0.0.1", port), "twin": ("127.0.0.1", twin)}
    else:
        doors = {"flooded": address(args.url)} | ({"twin": address(args.twin)} if args.twin else {})
    host, port = doors["flooded"]
    base = f"http://{host}:{port}"
    try:
        res["gateway_max_connections"] = cap = gateway_capacity(base)
        if cap is not None and args.idle + args.slowloris > cap:
            print(f"the flood's {args.idle + args.slowloris:,} connections are over the gateway's {cap:,} "
                  "(--max-connections x --gateway-workers): it churns instead of being held", flush=True)
        probe(doors, 3)  # warm-up
        res["before"] = timed_probe(base, doors, args.seconds)
        print("before", json.dumps(res["before"]), flush=True)
        cpu_at_start, flood_started = gateway_process(base).get("process_cpu_seconds_total"), time.monotonic()
        flood = Flood(host, port, args.idle, args.slowloris, args.procs, args.trickle_s, args.flood_nice,
                      args.flood_cpus)
        samples: list[dict[str, Any]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(base, flood, stop, samples), daemon=True)
        sampler.start()
        time.sleep(args.ramp_s)
        res["during"] = timed_probe(base, doors, args.seconds)
        print("during", json.dumps(res["during"]), flush=True)
        stop.set()
        sampler.join()
        res["flood"] = flood.end()
        res["samples"] = samples
        time.sleep(args.header_timeout_s + 2)  # (the flood's last connections closed)
        cpu_at_end = gateway_process(base).get("process_cpu_seconds_total")
        res["flood"]["seconds"] = time.monotonic() - flood_started
        if cpu_at_start is not None and cpu_at_end is not None:  # (the probes' own queries included)
            res["flood"]["gateway_cpu_s"] = cpu_at_end - cpu_at_start
        res["after"] = timed_probe(base, doors, args.seconds)
        res["load_average_at_end"] = os.getloadavg()
        print("after", json.dumps(res["after"]), flush=True)
    finally:
        stop_all(procs)
    res["ratios"] = ratios(res)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """The flooded door's p50 / p99 during the flood over: its own before and after, and the twin's
    in the same blocks (the paired figure)."""
    during = res["during"]["flooded"]["ms"]
    out = {}
    for name, ms in [("before", res["before"]["flooded"]["ms"]), ("after", res["after"]["flooded"]["ms"])] + \
            ([("twin_during", res["during"]["twin"]["ms"])] if "twin" in res["during"] else []):
        if ms.get("n") and during.get("n"):
            out[f"p50_vs_{name}"] = during["p50"] / ms["p50"]
            out[f"p99_vs_{name}"] = during["p99"] / ms["p99"]
    return out


if __name__ == "__main__":
    main()
