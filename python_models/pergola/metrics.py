"""Custom Prometheus metrics from the encoder, served on Triton's metrics port (8002).

    pergola_requests_total{model}            requests the encoder answered
    pergola_sequences_total{model}           texts (or pairs) embedded
    pergola_tokens_total{model}              tokens through the model
    pergola_steps_total{model,mode}          forward steps by mode: eager, warmup, capture, replay
    pergola_attention_backend{model,backend,use}  1 for the kernel in use (use: graph or eager)

Tokens per step is pergola_tokens_total / pergola_steps_total; queue wait is Triton's own
nv_inference_queue_duration_us.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

COUNTERS = ("requests", "sequences", "tokens")
MODES = ("eager", "warmup", "capture", "replay")


class EncoderMetrics:
    def __init__(self, pb_utils: Any, model: str, attention: dict[str, str]) -> None:
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
        self._seen: Counter[str] = Counter()

    def update(self, stats: Counter[str]) -> None:
        """Add what the engine counted since the last call."""
        for name, metric in self._counters.items():
            if stats[name] > self._seen[name]:
                metric.increment(stats[name] - self._seen[name])
        for mode, metric in self._steps.items():
            key = f"steps_{mode}"
            if stats[key] > self._seen[key]:
                metric.increment(stats[key] - self._seen[key])
        self._seen = Counter(stats)
