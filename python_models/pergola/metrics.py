"""Custom Prometheus metrics from the encoder, served on Triton's metrics port (8002).

    pergola_requests_total{model}            requests the encoder answered
    pergola_sequences_total{model}           texts (or pairs) embedded
    pergola_tokens_total{model}              tokens through the model
    pergola_steps_total{model,mode}          forward steps by mode: eager, warmup, capture, replay
    pergola_attention_backend{model,backend,use}  1 for the kernel in use (use: graph or eager)

Tokens per step is pergola_tokens_total / pergola_steps_total; queue wait is Triton's own
nv_inference_queue_duration_us.

Counters reach Triton at most once per `metrics_flush_s` seconds (default 1; 0 = after
every step), and the encode loop flushes the rest once it has been idle for a second. Why
batched: each update is a round trip from the stub to the server process, and the four of them
took 205 µs (p50) of every execute on a 2-core machine, inside the request's latency (16 µs
batched); Prometheus scrapes every 1-15 s anyway. Every call comes from the encode loop's one
thread (engine/loop.py): the stub's metric calls are IPC, and keeping them to one thread keeps
them from racing the loop's other traffic with the server.
"""

from __future__ import annotations

import ctypes
import time
from collections import Counter
from typing import Any

COUNTERS = ("requests", "sequences", "tokens")
MODES = ("eager", "warmup", "capture", "replay")


class EncoderMetrics:
    def __init__(self, pb_utils: Any, model: str, attention: dict[str, str],
                 flush_s: float = 1.0) -> None:
        self.flush_s = flush_s
        family = pb_utils.MetricFamily
        # Families must outlive their metrics (Triton refuses updates otherwise): keep them.
        self._families = {
            name: family(name=f"pergola_{name}_total", description=f"{name} processed by the encoder",
                         kind=family.COUNTER)
            for name in COUNTERS
        }
        self._counters = {name: fam.Metric(labels={"model": model}) for name, fam in self._families.items()}
        steps = family(name="pergola_steps_total", description="forward steps by execution mode",
                       kind=family.COUNTER)
        self._steps = {mode: steps.Metric(labels={"model": model, "mode": mode}) for mode in MODES}
        backend = family(name="pergola_attention_backend", description="attention kernel in use",
                         kind=family.GAUGE)
        self._families.update(steps=steps, backend=backend)
        self._backend = [backend.Metric(labels={"model": model, "backend": b, "use": use})
                         for use, b in attention.items()]
        for metric in self._backend:
            metric.set(1)
        # engine stats key -> counter: "requests", "sequences", "tokens", "steps_<mode>"
        self._by_key = dict(self._counters) | {f"steps_{mode}": m for mode, m in self._steps.items()}
        self._seen: Counter[str] = Counter()  # what Triton has been told
        self._flushed_at = float("-inf")

    def update(self, stats: Counter[str]) -> None:
        """Tell Triton the engine's running counts if the last flush is flush_s old."""
        if time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush(stats)

    def flush(self, stats: Counter[str]) -> None:
        """Add to Triton's counters what the engine counted since the last flush."""
        for key, metric in self._by_key.items():
            if stats[key] > self._seen[key]:
                metric.increment(stats[key] - self._seen[key])
        self._seen = Counter(stats)
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Keep the metric objects alive for the rest of the process (finalize). Deleting them
        removes counters that the model's next version has too (same names and labels: Triton
        hands both the same series), which crashed tritonserver during a version swap under
        traffic (heap corruption); left to the interpreter's exit, their destructors run after
        the stub's shared memory is gone and crash the stub. One reference nobody drops avoids
        both; the stub process ends right after."""
        for obj in [*self._families.values(), *self._counters.values(), *self._steps.values(), *self._backend]:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
