"""The encoder's Prometheus counters (pergola.metrics) with a stand-in for the Triton stub's
metrics API: updates are batched (one stub-to-server round trip per metric per flush, not per
request), and nothing counted is ever lost."""

from __future__ import annotations

import time
from collections import Counter

from pergola.metrics import EncoderMetrics


class FakeMetric:
    def __init__(self, log: list, labels: dict) -> None:
        self.log, self.labels, self.value = log, labels, 0

    def increment(self, n: int) -> None:
        self.log.append((tuple(sorted(self.labels.items())), n))
        self.value += n

    def set(self, v: float) -> None:
        self.value = v


class FakeFamily:
    COUNTER, GAUGE = "counter", "gauge"
    log: list = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict) -> FakeMetric:  # noqa: N802 - the stub's spelling
        return FakeMetric(FakeFamily.log, labels)


class FakePbUtils:
    MetricFamily = FakeFamily


def totals(metrics: EncoderMetrics) -> dict[str, int]:
    return {name: m.value for name, m in metrics._counters.items()} | \
        {f"steps_{mode}": m.value for mode, m in metrics._steps.items()}


def stats(n: int) -> Counter:
    return Counter(requests=n, sequences=2 * n, tokens=100 * n, steps_replay=n)


def test_updates_within_the_interval_wait_and_a_flush_sends_the_rest():
    FakeFamily.log.clear()
    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"}, flush_s=60)
    metrics.update(stats(1))  # the first update goes out at once
    assert totals(metrics)["requests"] == 1
    sent = len(FakeFamily.log)
    for n in range(2, 50):  # a burst inside the interval: no round trips
        metrics.update(stats(n))
    assert len(FakeFamily.log) == sent and totals(metrics)["requests"] == 1
    metrics.flush(stats(49))  # what the encode loop does once idle for a second
    assert totals(metrics) == {"requests": 49, "sequences": 98, "tokens": 4900, "steps_eager": 0,
                               "steps_warmup": 0, "steps_capture": 0, "steps_replay": 49}
    assert len(FakeFamily.log) == sent + 4  # one increment per counter that moved


def test_interval_zero_flushes_every_update():
    FakeFamily.log.clear()
    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"}, flush_s=0)
    for n in range(1, 4):
        metrics.update(stats(n))
        assert totals(metrics)["tokens"] == 100 * n


def test_the_interval_passing_sends_the_next_update():
    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"}, flush_s=0.05)
    metrics.update(stats(1))
    metrics.update(stats(2))
    assert totals(metrics)["requests"] == 1
    time.sleep(0.06)
    metrics.update(stats(3))
    assert totals(metrics)["tokens"] == 300


def test_close_keeps_the_metric_objects_for_the_process():
    """finalize must neither delete the series (the next version shares them) nor leave their
    destructors to the interpreter's exit: each object keeps one reference forever."""
    import sys

    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"})
    objects = [*metrics._families.values(), *metrics._counters.values(), *metrics._steps.values()]
    before = [sys.getrefcount(o) for o in objects]
    metrics.close()
    assert [sys.getrefcount(o) for o in objects] == [n + 1 for n in before]
