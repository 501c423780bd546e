"""Recovery: when a model's Python stub process dies, that model alone is loaded again while the
others keep answering; the whole server is restarted only when that fails, or when tritonserver
itself crashes, hangs or runs away with memory (server.serve_supervised).

Triton 2.51 does not restart a stub that died (out of memory, a killed process, a CUDA fault):
every later request that reaches it fails with "Stub process 'NAME_0_0' is not healthy" (the
gateway answers 503 + Retry-After) while the model, the server and the repository index all
still say READY. What brings the model back (measured on 2.51, 2-core CPU host, tests/
test_fault_locality.py): a repository load of that one model (NAME_tokenizer or NAME_encoder)
whose `config` override differs from the one it runs, here by a new value of the parameter
admin.RECOVERY_PARAMETER. Triton loads a fresh copy beside the broken one, swaps it in once
ready (the ensembles that use it with it), and the other models never fail meanwhile: back in
1.5-3.7 s after a tokenizer's death, 5-26 s after an encoder's on the shared 2-core CPU host,
depending on its load (perf/results/2026-12-06-dda9d96-cpu). What did not work: a load that
changes nothing is a no-op (Triton compares the config and the files); an unload never
completes once a request has reached the dead stub (the Python backend's response factory for
that request keeps the model alive); a load over HTTP runs on one of Triton's HTTP threads and
every inference request on that thread's connections waited for it (11.6 s for another model's
query), so loads go over gRPC. The replaced copy is never unloaded either (same reason): its
remaining stubs are ended here, a few seconds after the swap, and at shutdown the server is not
waited for once only such copies are left (server._wait_exit).

While a model is being loaded again it is listed in REPO/RECOVERING_FILE (part name -> since,
reason), and the gateway reports it not ready (GET /health?model=NAME, gateway/state.py);
Triton's own per-model readiness stays true, as Triton does not know.
Models an operator unloaded on purpose are not READY and are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pergola.triton.admin import AdminError, RepositoryClient

log = logging.getLogger("pergola.triton.supervisor")
RECOVERING_FILE = ".recovering.json"  # in the repository folder: the parts being loaded again


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


def read_recovering(repo: str | Path) -> dict[str, dict]:
    """The parts being loaded again (RECOVERING_FILE), {} when none or unreadable."""
    try:
        return json.loads((Path(repo) / RECOVERING_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_recovering(repo: Path, parts: dict[str, dict]) -> None:
    """Replace RECOVERING_FILE at once (a reader never sees half of it); none: removed."""
    path = repo / RECOVERING_FILE
    if not parts:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(parts))
    os.replace(tmp, path)


class Loader(Protocol):
    """Loads one model again (admin.ModelLoader: Triton's repository API over gRPC)."""

    def reload(self, name: str, mark: str, timeout_s: float) -> None: ...


@dataclass
class Recovery:
    """One model being loaded again, in a thread of its own."""

    model: str
    reason: str
    old: set[int]  # the stubs of the copy being replaced
    started: float = field(default_factory=time.monotonic)
    error: str | None = None  # why it failed (the server is then restarted)
    done: bool = False


class Supervisor:
    """Watches one server: a dead stub brings its model back (`loader`), and watch() returns
    when the server itself must be restarted."""

    def __init__(self, repo: Path, api: RepositoryClient, loader: Loader | None = None, interval_s: float = 0.5,
                 live_every_s: float = 2.0, live_failures: int = 3, memory_limit_bytes: int = 0,
                 reload_timeout_s: float = 300.0, old_copy_grace_s: float = 5.0) -> None:
        self.repo = Path(repo)
        self.api = api
        self.loader = loader  # None: every dead stub restarts the server, as before per-model recovery
        # Triton 2.51's HTTP server allocates and fills whatever element count a JSON input's shape
        # claims (2^40 INT64: std::bad_alloc and abort where the host refuses, but on a host that
        # overcommits it kept filling, perf/results/2026-12-05-05e666b/hardening_diag.log), so the
        # OOM killer would end it later, maybe with other processes. Over this, it is restarted like
        # a crashed server. 0: no limit.
        self.memory_limit_bytes = memory_limit_bytes
        self.interval_s = interval_s
        self.live_every_s = live_every_s  # how often /v2/health/live is asked
        self.live_failures = live_failures  # unanswered in a row before the server counts as hung
        self.reload_timeout_s = reload_timeout_s
        self.old_copy_grace_s = old_copy_grace_s  # the replaced copy's in-flight requests may finish
        self.recoveries: dict[str, Recovery] = {}  # model -> the latest one
        self.recovered = 0  # models brought back while this server ran (each leaves a copy behind)
        self._lock = threading.Lock()

    def watch(self, running: Callable[[], bool], pid: int | None = None) -> str | None:
        """Block while `running()`, bringing back models whose stubs die; return why the server
        must be restarted (a model could not be brought back, the server stopped answering: a
        crashed process can hang in its crash handler, or tritonserver's process `pid` holds
        more memory than its limit), or None once `running()` is false (the server exited, or
        shutdown began)."""
        with self._lock:  # (a server restarted mid-recovery: its recoveries are over)
            self.recoveries = {}
            self.recovered = 0
            self._publish()
        expected = self._settle()
        unanswered, next_live = 0, time.monotonic() + self.live_every_s
        while running():
            time.sleep(self.interval_s)
            if not running():  # (a crash seen in the output while asleep: no call may wait on it)
                break
            if pid is not None and self.memory_limit_bytes and (rss := resident_bytes(pid)) > self.memory_limit_bytes:
                return (f"tritonserver holds {rss / 2**30:.1f} GB, over its {self.memory_limit_bytes / 2**30:.1f} GB "
                        "limit (--server-memory-gb; a request that claimed a huge input?)")
            failed = self._failed_recovery()
            if failed:
                return failed
            reason = self._check_stubs(expected, running)
            if reason:
                return reason
            if time.monotonic() >= next_live and running():
                next_live = time.monotonic() + self.live_every_s
                unanswered = 0 if self.api.live() else unanswered + 1
                if unanswered >= self.live_failures:
                    return f"tritonserver has not answered /v2/health/live for {unanswered} checks in a row"
        return None

    def _settle(self) -> dict[str, int]:
        """Per model, the stubs it should have: its config's count, or more if Triton started
        more (KIND_GPU places `count` instances on every visible GPU). The fewest seen over a
        couple of seconds: a stub Triton ran only to complete a config may still be exiting."""
        settled: dict[str, int] = {}
        for i in range(4):
            seen = live_stubs(self.repo)
            settled = seen if i == 0 else {name: min(n, seen.get(name, 0)) for name, n in settled.items()}
            time.sleep(self.interval_s)
        return {name: max(n, settled.get(name, 0)) for name, n in expected_instances(self.repo).items()}

    def _check_stubs(self, expected: dict[str, int], running: Callable[[], bool]) -> str | None:
        """Start a recovery for each READY model short of stubs (restart reason without a loader)."""
        pids = stub_pids(self.repo)
        with self._lock:
            busy = {name for name, r in self.recoveries.items() if not r.done}
        short = {name: len(pids.get(name, [])) for name, want in expected.items()
                 if len(pids.get(name, [])) < want and name not in busy}
        if not short or not running():
            return None
        try:
            # a short wait: a server hung in its crash handler may never answer
            states = self.api.index(timeout=2 * self.live_every_s)
        except (AdminError, OSError) as e:  # going down, or busy: look again
            log.warning("stub supervisor: repository index failed: %s", e)
            return None
        for name in (n for n in short if states.get(n) == "READY"):
            reason = f"model {name} has {short[name]} of {expected[name]} stub processes alive"
            if self.loader is None:
                return reason
            self._start_recovery(name, reason, set(pids.get(name, [])))
        return None

    def _start_recovery(self, name: str, reason: str, old: set[int]) -> None:
        print(f"pergola: {reason}; loading {name} again (the other models keep serving)", flush=True)
        recovery = Recovery(name, reason, old)
        with self._lock:
            self.recoveries[name] = recovery
            self._publish()
        threading.Thread(target=self._recover, args=(recovery,), name=f"recover-{name}", daemon=True).start()

    def _recover(self, recovery: Recovery) -> None:
        """Load the model again (a changed config: admin.RECOVERY_PARAMETER), then end what is left
        of the copy it replaced."""
        try:
            self.loader.reload(recovery.model, f"{os.getpid()}-{time.time_ns()}", self.reload_timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure means the server restart fallback
            recovery.error = f"model {recovery.model} could not be loaded again ({e})"
        took = time.monotonic() - recovery.started
        with self._lock:
            recovery.done = True
            if self.recoveries.get(recovery.model) is not recovery:
                return  # the server was restarted meanwhile: this one is over
            self.recovered += recovery.error is None
            self._publish()
        if recovery.error is None:
            print(f"pergola: {recovery.model} is back ({took:.1f} s after its stub was seen dead)", flush=True)
            time.sleep(self.old_copy_grace_s)
            end_processes(recovery.old & set(stub_pids(self.repo).get(recovery.model, [])))

    def _failed_recovery(self) -> str | None:
        with self._lock:
            failed = [r for r in self.recoveries.values() if r.error]
        return f"{failed[0].reason}; {failed[0].error}" if failed else None

    def _publish(self) -> None:
        """RECOVERING_FILE from the recoveries in progress (with the lock held)."""
        write_recovering(self.repo, {r.model: {"since": time.time() - (time.monotonic() - r.started),
                                               "reason": r.reason}
                                     for r in self.recoveries.values() if not r.done})


def end_processes(pids: set[int]) -> None:
    """SIGKILL each of `pids` (the stubs of a replaced copy, as stub_pids still lists them)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
