"""Where a request's time goes inside the encoder adapter (perf/bench_adapter.py reads it).

Off unless PERGOLA_ADAPTER_TIMING names a folder when the encoder initializes; off, the adapter
pays one `is None` test per mark. On, each request gets a dict of marks, time.monotonic_ns():
CLOCK_MONOTONIC on Linux, the clock of Triton's own trace timestamps, so the two line up:

    execute      execute() took the request          (Triton: COMPUTE_START comes before)
    decoded      its input arrays read
    validated    Engine.validate passed
    options      its options read (DIMENSIONS, NORMALIZE, ENCODING / TOP_N / RAW_SCORES)
    submitted    queued on the encode loop           (execute() then returns: COMPUTE_END)
    started      the loop put its first sequence into a step
    gathered     a query answered at once: its step's ids gathered (Engine.last_step_marks) ...
    filled       … in the step's buffers, copies to the device queued
    planned      … its attention planned
    queued       … its forward queued (a graph replay launched, or the eager kernels)
    launched     … its copy back queued too
    on_host      … its step's result on the host
    engine_done  the loop handed its result back (step done, copied to the host)
    metered      a query answered at once: its metrics recorded (the loop meters its own steps)
    outputs      its output arrays and pb_utils.Tensor objects made
    built        its response built
    sent         sender.send() returned              (Triton: REQUEST_END)

and every call of the encode loop's metrics hook its duration (`metrics_ns`). Everything is
written to FOLDER/<model>-<pid>.json at finalize, at most MAX_REQUESTS requests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pergola.config.settings import settings

ENV = "PERGOLA_ADAPTER_TIMING"
MAX_REQUESTS = 200_000


class AdapterTiming:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[dict] = []
        self.metrics_ns: list[int] = []

    @classmethod
    def from_env(cls, model: str) -> AdapterTiming | None:
        folder = settings().adapter_timing
        return cls(Path(folder) / f"{model}-{os.getpid()}.json") if folder else None

    def begin(self) -> dict | None:
        """A new request's marks ({"execute": now}), or None past MAX_REQUESTS."""
        if len(self.requests) >= MAX_REQUESTS:
            return None
        marks = {"execute": time.monotonic_ns()}
        self.requests.append(marks)
        return marks

    def write(self) -> None:
        for marks in self.requests:
            marks.pop("job", None)  # the Job the adapter parked here to read its start time
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"requests": self.requests, "metrics_ns": self.metrics_ns}))
