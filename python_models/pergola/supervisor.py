"""Recovery: reload a model whose Python stub process died.

Triton 2.51 does not restart a Python-backend stub that crashed (out of memory, a killed
process, a CUDA fault): every later request to that model fails with "Stub process ... is not
healthy" until the model is loaded again. `pergola serve` runs tritonserver in explicit
model-control mode and this supervisor beside it: every `interval_s` it counts each model's live
stub processes (from /proc) and, when one has fewer than its config asks for, reloads that model
through the repository API. A reload replaces the model's instances; ensembles that reference it
keep working, and requests fail only while the stub is down.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from pathlib import Path

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


def reload_model(http_port: int, name: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/models/{name}/load",
                                 data=json.dumps({}).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def supervise(repo: Path, http_port: int, alive, interval_s: float = 2.0) -> None:
    """Loop while `alive()`: reload every model with a dead stub. Runs in `pergola serve`."""
    expected = expected_instances(repo)
    while alive():
        time.sleep(interval_s)
        running = live_stubs(repo)
        for name, want in expected.items():
            have = running.get(name, 0)
            if have < want and alive():
                log.warning("model %s: %d of %d stub processes alive; reloading it", name, have, want)
                try:
                    reload_model(http_port, name)
                    log.warning("model %s reloaded", name)
                except OSError as e:  # server shutting down, or the load failed: try again later
                    log.warning("reloading %s failed: %s", name, e)
