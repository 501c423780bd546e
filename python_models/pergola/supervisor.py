"""Recovery: restart the server when a model's Python stub process dies, every time it dies
(and when tritonserver itself crashes: server.serve_supervised).

Triton 2.51 does not restart a Python-backend stub that crashed (out of memory, a killed
process, a CUDA fault): every later request to that model fails with "Stub process ... is not
healthy" while the model, the server and the repository index all still say READY. Reloading
the model does not work reliably: a load of a loaded model whose files did not change is a
no-op, and an unload never completes once a request has reached the dead stub (the Python
backend's response factory for that request keeps the model alive), which also holds
shutdown until Triton's exit timeout. So `pergola serve` watches the stubs (this module, every
`interval_s`, from /proc) and, when a READY model has fewer live stubs than it started with,
stops tritonserver (its stubs and shared memory with it) and starts it again: readiness is
false until every model is back, and each recovery starts from a clean process.
Models an operator unloaded on purpose are not READY and are left alone.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Callable

from pergola.admin import AdminError, RepositoryClient

log = logging.getLogger("pergola.supervisor")


def expected_instances(repo: Path) -> dict[str, int]:
    """Python-backend models of the repository -> instance count from their config.pbtxt."""
    out = {}
    for config in sorted(repo.glob("*/config.pbtxt")):
        text = config.read_text()
        if 'backend: "python"' not in text:
            continue
        counts = [int(n) for n in re.findall(r"count:\s*(\d+)", text)]
        out[config.parent.name] = sum(counts) or 1
    return out


def stub_pids(repo: Path) -> dict[str, list[int]]:
    """Model name -> pids of the running `triton_python_backend_stub` processes serving it."""
    pids: dict[str, list[int]] = {}
    prefix = str(repo.resolve()) + "/"
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # the process ended while we looked
        if len(args) < 2 or not args[0].endswith(b"triton_python_backend_stub"):
            continue
        model_py = args[1].decode(errors="replace")
        if model_py.startswith(prefix):
            name = model_py[len(prefix):].split("/", 1)[0]
            pids.setdefault(name, []).append(int(cmdline.parent.name))
    return pids


def live_stubs(repo: Path) -> dict[str, int]:
    """Model name -> number of running stub processes serving it."""
    return {name: len(p) for name, p in stub_pids(repo).items()}


def resident_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), 0 once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Supervisor:
    """Watches one server for a dead stub, a hung server or one whose own memory runs away
    (server.serve_supervised restarts it)."""

    def __init__(self, repo: Path, api: RepositoryClient, interval_s: float = 0.5,
                 live_every_s: float = 2.0, live_failures: int = 3, memory_limit_bytes: int = 0) -> None:
        self.repo = repo
        self.api = api
        # Triton 2.51's HTTP server allocates and fills whatever element count a JSON input's shape
        # claims (2^40 INT64: std::bad_alloc and abort where the host refuses, but on a host that
        # overcommits it kept filling: 113 GB resident a minute later, H100 host,
        # perf/results/2026-12-05-05e666b/hardening_diag.log), so the OOM killer would end it later,
        # maybe with other processes. Over this, it is restarted like a crashed server. 0: no limit.
        self.memory_limit_bytes = memory_limit_bytes
        self.interval_s = interval_s
        self.live_every_s = live_every_s  # how often /v2/health/live is asked
        self.live_failures = live_failures  # unanswered in a row before the server counts as hung

    def watch(self, running: Callable[[], bool], pid: int | None = None) -> str | None:
        """Block while `running()`; return why the server must be restarted (a READY model lost
        a stub, the server stopped answering: a crashed process can hang in its crash handler,
        or tritonserver's process `pid` holds more memory than its limit), or None once
        `running()` is false (the server exited, or shutdown began)."""
        # Per model, the stubs it should have: its config's count, or more if Triton started
        # more (KIND_GPU places `count` instances on every visible GPU). The fewest seen over a
        # couple of seconds: a stub Triton ran only to complete a config may still be exiting.
        settled: dict[str, int] = {}
        for i in range(4):
            seen = live_stubs(self.repo)
            settled = seen if i == 0 else {name: min(n, seen.get(name, 0)) for name, n in settled.items()}
            time.sleep(self.interval_s)
        expected = {name: max(n, settled.get(name, 0)) for name, n in expected_instances(self.repo).items()}
        unanswered, next_live = 0, time.monotonic() + self.live_every_s
        while running():
            time.sleep(self.interval_s)
            if not running():  # (a crash seen in the output while asleep: no call may wait on it)
                break
            if pid is not None and self.memory_limit_bytes and (rss := resident_bytes(pid)) > self.memory_limit_bytes:
                return (f"tritonserver holds {rss / 2**30:.1f} GB, over its {self.memory_limit_bytes / 2**30:.1f} GB "
                        "limit (--server-memory-gb; a request that claimed a huge input?)")
            alive = live_stubs(self.repo)
            short = {name: alive.get(name, 0) for name, want in expected.items() if alive.get(name, 0) < want}
            if short and running():
                try:
                    # a short wait: a server hung in its crash handler may never answer
                    states = self.api.index(timeout=2 * self.live_every_s)
                except (AdminError, OSError) as e:  # going down, or busy: look again
                    log.warning("stub supervisor: repository index failed: %s", e)
                    continue
                dead = [name for name in short if states.get(name) == "READY"]
                if dead:
                    return f"model {dead[0]} has {short[dead[0]]} of {expected[dead[0]]} stub processes alive"
            if time.monotonic() >= next_live and running():
                next_live = time.monotonic() + self.live_every_s
                unanswered = 0 if self.api.live() else unanswered + 1
                if unanswered >= self.live_failures:
                    return f"tritonserver has not answered /v2/health/live for {unanswered} checks in a row"
        return None
