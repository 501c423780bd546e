"""The encoder's Prometheus counters (pergola.triton.metrics) with a stand-in for the Triton stub's
metrics API: updates are batched (one stub-to-server round trip per metric per flush, not per
request), and nothing counted is ever lost."""

from __future__ import annotations

import time
from collections import Counter

from pergola.triton.metrics import EncoderMetrics


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


def test_a_histogram_sends_cumulative_buckets_sum_and_count_and_only_what_moved():
    from pergola.triton.metrics import Histogram

    FakeFamily.log.clear()
    h = Histogram(FakePbUtils, "pergola_x_seconds", "x", (0.1, 1.0), {"model": "m"})
    for v in (0.05, 0.5, 0.5, 7.0):
        h.observe(v)
    h.flush()
    sent = {dict(labels).get("le", "sum/count"): n for labels, n in FakeFamily.log}
    assert [m.value for m in h._buckets] == [1, 3, 4]  # le 0.1, 1.0, +Inf
    assert [dict(m.labels)["le"] for m in h._buckets] == ["0.1", "1.0", "+Inf"]
    assert (h._count.value, h._sum.value) == (4, 8.05) and len(sent) == 4
    FakeFamily.log.clear()
    h.flush()  # nothing new: no round trips
    assert FakeFamily.log == []
    h.observe(0.2)
    h.flush()  # only the buckets at or above 0.2 move, and the sum and count
    assert [m.value for m in h._buckets] == [1, 4, 5] and len(FakeFamily.log) == 4


def test_the_encoder_observes_each_steps_time_tokens_and_queue_waits():
    from types import SimpleNamespace

    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"}, flush_s=60,
                             info={"hub_id": "org/name", "revision": "abc", "dtype": "float32"})
    jobs = [SimpleNamespace(queued_at=1.0, started_at=1.25), SimpleNamespace(queued_at=2.0, started_at=2.0)]
    loop = SimpleNamespace(throughput=SimpleNamespace(last=(384, 0.004)), completed=jobs)
    metrics.update(stats(1), loop)
    hist = metrics.histograms
    assert (hist["step_tokens"].total, hist["step_seconds"].total, hist["queue_wait"].total) == (384, 0.004, 0.25)
    assert hist["queue_wait"].counts[0] == 1  # the job that did not wait
    assert metrics._info.labels == {"model": "m", "attention": "graph:torch_flash", "hub_id": "org/name",
                                    "revision": "abc", "dtype": "float32"} and metrics._info.value == 1


def test_while_busy_histograms_go_out_with_every_tenth_flush_and_all_of_them_once_idle():
    from types import SimpleNamespace

    from pergola.triton.metrics import HISTOGRAM_FLUSHES

    FakeFamily.log.clear()
    metrics = EncoderMetrics(FakePbUtils, "m", {"graph": "torch_flash"}, flush_s=0.01)
    loop = SimpleNamespace(throughput=SimpleNamespace(last=(64, 0.001)), completed=[])

    def bucket_updates() -> int:
        return sum(1 for labels, _ in FakeFamily.log if "le" in dict(labels))

    metrics.update(stats(1), loop)  # the first flush sends everything
    sent = bucket_updates()
    assert sent > 0 and metrics._histograms_at > float("-inf")
    time.sleep(0.012)
    metrics.update(stats(2), loop)  # a counter flush, not yet the histograms'
    assert totals(metrics)["requests"] == 2 and bucket_updates() == sent
    assert metrics.histograms["step_tokens"]._count.value == 1
    time.sleep(0.01 * HISTOGRAM_FLUSHES)
    metrics.update(stats(3), loop)
    assert metrics.histograms["step_tokens"]._count.value == 3
    metrics.update(stats(4), loop)  # within the interval: kept here...
    metrics.flush(stats(4))  # ...until the loop is idle
    assert metrics.histograms["step_tokens"]._count.value == 4


def test_a_tokenizer_sends_its_histogram_a_tenth_as_often_and_all_of_it_at_close():
    from pergola.triton.metrics import HISTOGRAM_FLUSHES, TokenizerMetrics

    metrics = TokenizerMetrics(FakePbUtils, "m_tokenizer", flush_s=0.01)
    metrics.observe(0.001)  # the first goes out at once
    metrics.observe(0.002)
    assert metrics.seconds._count.value == 1
    time.sleep(0.01 * HISTOGRAM_FLUSHES)
    metrics.observe(0.003)
    assert metrics.seconds._count.value == 3
    metrics.observe(0.004)
    metrics.close()  # finalize
    assert metrics.seconds._count.value == 4 and abs(metrics.seconds._sum.value - 0.01) < 1e-12
