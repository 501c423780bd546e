"""Custom Prometheus metrics from the encoder, served on Triton's metrics port (8002).

    pergola_requests_total{model}            requests the encoder answered
    pergola_sequences_total{model}           texts (or pairs) embedded
    pergola_tokens_total{model}              tokens through the model
    pergola_steps_total{model,mode}          forward steps by mode: eager, warmup, capture, replay
    pergola_attention_backend{model,backend,use}  1 for the kernel in use (use: graph or eager)

    pergola_info{model,hub_id,revision,dtype,attention}  1: what the encoder serves (docs/operations.md: Metrics)

Histograms, as Prometheus histograms (NAME_bucket{le}, NAME_sum, NAME_count):

    pergola_tokenize_seconds{model}          tokenizing one request (the NAME_tokenizer model)
    pergola_queue_wait_seconds{model}        a request's wait in the encoder, from its arrival to
                                             the step that takes its first text
    pergola_step_seconds{model}              one forward step, busy time (host preparation, GPU
                                             work and the copy back)
    pergola_step_tokens{model}               tokens in one forward step

Triton's own nv_inference_queue_duration_us is the wait before execute(), which the encoder's
execute ends at once: its real queue is the encode loop's, measured by pergola_queue_wait_seconds.

Counters reach Triton at most once per `metrics_flush_s` seconds (default 1; 0 = after every
step), the encoder's histograms at most once per ten of those while it is busy (HISTOGRAM_FLUSHES),
and the encode loop flushes the rest once it has been idle for a second.
Why batched: each update is a round trip from the stub to the server process, and one per
counter on every execute sat inside the request's latency, an order of magnitude more than
batched; Prometheus scrapes every 1-15 s anyway. For the same reason histograms are counted
here and sent as COUNTER series rather than through the HISTOGRAM kind that Triton 2.51's stub
has, whose observe() is a round trip per value (per step, per request); a flush sends one update
per bucket that moved, whatever the rate. Every call comes from the encode loop's one
thread (engine/loop.py): the stub's metric calls are IPC, and keeping them to one thread keeps
them from racing the loop's other traffic with the server.
"""

from __future__ import annotations

import bisect
import ctypes
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

COUNTERS = ("requests", "sequences", "tokens")
MODES = ("eager", "warmup", "capture", "replay")
# Bucket bounds. Seconds: 100 µs (a MiniLM step on a GPU, a short text's tokenization) to 10 s
# (max_queue_seconds' default); tokens: up to the GPU's default step budget (16,384) and beyond.
SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# While the encoder is busy its histograms go out with every tenth counter flush: sending the
# three of them is ~35 round trips (each cumulative bucket at or above a value moves), milliseconds
# of the encode loop's time on a CPU host, against a few round trips for the counters.
# A tokenizer's one histogram goes out as rarely.
HISTOGRAM_FLUSHES = 10


def _le(bound: float) -> str:
    """A bucket's `le` label as Prometheus clients write it (0.005, 1.0, 512.0, +Inf)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class Histogram:
    """A Prometheus histogram counted in the stub and sent at flush() as its three series,
    NAME_bucket{le} (cumulative), NAME_sum and NAME_count, each a COUNTER family of Triton's.
    PromQL reads them as any histogram: histogram_quantile(0.99, rate(NAME_bucket[5m]))."""

    def __init__(self, pb_utils: Any, name: str, description: str, buckets: Iterable[float],
                 labels: dict[str, str]) -> None:
        family = pb_utils.MetricFamily
        self.bounds = (*buckets, float("inf"))
        self.families = [family(name=f"{name}{suffix}", description=description, kind=family.COUNTER)
                         for suffix in ("_bucket", "_sum", "_count")]
        self._buckets = [self.families[0].Metric(labels=labels | {"le": _le(b)}) for b in self.bounds]
        self._sum, self._count = (f.Metric(labels=labels) for f in self.families[1:])
        self.counts = [0] * len(self.bounds)  # observations per bucket (not cumulative)
        self.total = 0.0
        self._sent = ([0] * len(self.bounds), 0.0)

    @property
    def objects(self) -> list[Any]:
        return [*self.families, *self._buckets, self._sum, self._count]

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        """One increment per cumulative bucket that moved, and the sum and count if any did."""
        sent, sent_total = self._sent
        cumulative = [sum(self.counts[:i + 1]) for i in range(len(self.counts))]
        for metric, now, before in zip(self._buckets, cumulative, sent):
            if now > before:
                metric.increment(now - before)
        if cumulative[-1] > sent[-1]:
            self._count.increment(cumulative[-1] - sent[-1])
            self._sum.increment(max(self.total - sent_total, 0.0))
        self._sent = (cumulative, self.total)


def keep_forever(objects: Iterable[Any]) -> None:
    """Keep Triton metric objects alive for the rest of the process (finalize). Deleting them
    removes series that the model's next version has too (same names and labels: Triton hands
    both the same series), which crashed tritonserver during a version swap under traffic (heap
    corruption); left to the interpreter's exit, their destructors run after the stub's shared
    memory is gone and crash the stub. One reference nobody drops avoids both; the stub process
    ends right after."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class TokenizerMetrics:
    """pergola_tokenize_seconds of a NAME_tokenizer model, sent from its execute() thread at most
    every HISTOGRAM_FLUSHES * flush_s seconds (what came after, with the next request past that,
    and in finalize): sending it is tens of round trips, inside that request's time."""

    def __init__(self, pb_utils: Any, model: str, flush_s: float = 1.0) -> None:
        self.flush_s = flush_s
        self.seconds = Histogram(pb_utils, "pergola_tokenize_seconds", "seconds to tokenize one request",
                                 SECONDS_BUCKETS, {"model": model})
        self._flushed_at = float("-inf")

    def observe(self, seconds: float) -> None:
        self.seconds.observe(seconds)
        if time.monotonic() - self._flushed_at >= HISTOGRAM_FLUSHES * self.flush_s:
            self.flush()

    def flush(self) -> None:
        self.seconds.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        keep_forever(self.seconds.objects)


def info_labels(cfg: Any) -> dict[str, str]:
    """pergola_info's labels from an EngineConfig: the Hub id and commit (empty for a local
    folder) and the compute dtype in use."""
    return {"hub_id": cfg.model_id or "", "revision": cfg.model_revision or "", "dtype": cfg.compute_dtype}


class EncoderMetrics:
    def __init__(self, pb_utils: Any, model: str, attention: dict[str, str],
                 flush_s: float = 1.0, info: dict[str, str] | None = None) -> None:
        """info: the pergola_info labels besides `model` (hub_id, revision, dtype)."""
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
        served = family(name="pergola_info", description="what the encoder serves: Hub id, revision, dtype, "
                                                         "attention kernels (value 1)", kind=family.GAUGE)
        self._families.update(steps=steps, backend=backend, info=served)
        self._backend = [backend.Metric(labels={"model": model, "backend": b, "use": use})
                         for use, b in attention.items()]
        kernels = ",".join(f"{use}:{b}" for use, b in sorted(attention.items()))
        self._info = served.Metric(labels={"model": model, "attention": kernels, **(info or {})})
        for metric in [*self._backend, self._info]:
            metric.set(1)
        labels = {"model": model}
        self.histograms = {
            "queue_wait": Histogram(pb_utils, "pergola_queue_wait_seconds", "seconds a request waited in the "
                                    "encoder before its first step", SECONDS_BUCKETS, labels),
            "step_seconds": Histogram(pb_utils, "pergola_step_seconds", "busy seconds of one forward step",
                                      SECONDS_BUCKETS, labels),
            "step_tokens": Histogram(pb_utils, "pergola_step_tokens", "tokens in one forward step",
                                     TOKEN_BUCKETS, labels),
        }
        # engine stats key -> counter: "requests", "sequences", "tokens", "steps_<mode>"
        self._by_key = dict(self._counters) | {f"steps_{mode}": m for mode, m in self._steps.items()}
        self._seen: Counter[str] = Counter()  # what Triton has been told
        self._flushed_at = self._histograms_at = float("-inf")

    def update(self, stats: Counter[str], loop: Any = None) -> None:
        """After a step: count it (and, given the EncodeLoop, its time, tokens and the queue waits
        of the requests it finished); tell Triton if the last flush is flush_s old, and the
        histograms if theirs is HISTOGRAM_FLUSHES times that."""
        if loop is not None:
            self.observe_step(loop)
        now = time.monotonic()
        if now - self._flushed_at >= self.flush_s:
            self.flush(stats, histograms=now - self._histograms_at >= HISTOGRAM_FLUSHES * self.flush_s)

    def observe_step(self, loop: Any) -> None:
        """The latest step as engine/loop.py records it: throughput.last, completed jobs."""
        if loop.throughput.last is not None:
            tokens, seconds = loop.throughput.last
            self.histograms["step_tokens"].observe(tokens)
            self.histograms["step_seconds"].observe(seconds)
        for job in loop.completed:
            self.histograms["queue_wait"].observe(max(job.started_at - job.queued_at, 0.0))

    def observe_at_once(self, tokens: int, seconds: float) -> None:
        """A query the adapter computed at once (EncodeLoop.run_now): its own step, no queue wait."""
        self.histograms["step_tokens"].observe(tokens)
        self.histograms["step_seconds"].observe(seconds)
        self.histograms["queue_wait"].observe(0.0)

    def flush(self, stats: Counter[str], histograms: bool = True) -> None:
        """Add to Triton's counters what the engine counted since the last flush (and to the
        histograms what they observed: the idle flush and finalize send them always)."""
        for key, metric in self._by_key.items():
            if stats[key] > self._seen[key]:
                metric.increment(stats[key] - self._seen[key])
        if histograms:
            for histogram in self.histograms.values():
                histogram.flush()
            self._histograms_at = time.monotonic()
        self._seen = Counter(stats)
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        """Keep every metric object for the rest of the process (keep_forever says why)."""
        keep_forever([*self._families.values(), *self._counters.values(), *self._steps.values(),
                      *self._backend, self._info, *(o for h in self.histograms.values() for o in h.objects)])
