"""The query lane (engine/scheduler.py LaneQueue, engine/loop.py): a small request waits in a
queue of its own, its step comes first (topped up with bulk sequences that fit), and it runs
between two layers of the bulk step in flight, so it is answered before that step ends; results
do not depend on any of this.

On the CPU the encode loop runs each step synchronously, so "between layers" is literal: the
query's forward runs inside the bulk step's forward. The GPU form (its own buffers and graphs,
one stream) is checked in tests/test_gpu.py; its speed is perf/bench_mixed.py's."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import cosine_rows
from pergola.config.engine import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.engine.loop import EncodeLoop, Job
from pergola.engine.scheduler import LaneQueue


def ids_request(n: int, length: int, seed: int) -> EncodeRequest:
    rng = np.random.default_rng(seed)
    return EncodeRequest(rng.integers(1000, 29000, n * length).astype(np.int64), np.full(n, length, np.int32))


# --- LaneQueue ------------------------------------------------------------------------------
def test_queries_wait_apart_and_their_steps_hold_no_bulk_work():
    q = LaneQueue(max_batch_tokens=1024, max_batch_seqs=64, query_tokens=256)
    q.add("bulk", [512] * 8)
    q.add("query", [100])
    q.add("q2", [200, 50])
    assert q.has_queries and q.queued_tokens == 4096 + 350
    step = q.next_step()
    assert step.lane == 1 and {s.request for s in step.seqs} == {"query"} and step.num_tokens == 100
    step = q.next_step()
    assert step.lane == 1 and [s.request for s in step.seqs] == ["q2", "q2"]
    assert not q.has_queries
    step = q.next_step()
    assert step.lane == 0 and step.num_tokens == 1024 and {s.request for s in step.seqs} == {"bulk"}


def test_a_query_waits_for_queries_only_and_bulk_work_for_everything_before_it():
    q = LaneQueue(max_batch_tokens=1024, max_batch_seqs=64, query_tokens=256)
    q.add("bulk", [512] * 8)
    q.add("query", [100])
    assert q.work_ahead(50) == 0  # smaller than the queued query: nothing runs before it
    assert q.work_ahead(200) == 100  # the queued query only, not the bulk tokens
    assert q.work_ahead(4096) == 100 + 4096
    assert q.finish_lines() == {"query": 100, "bulk": 100 + 4096}
    q.remove("query")
    q.remove("bulk")
    assert not q and q.queued_tokens == 0


def test_without_query_tokens_it_is_one_queue():
    q = LaneQueue(max_batch_tokens=1024, max_batch_seqs=64, query_tokens=0)
    q.add("bulk", [512] * 4)
    q.add("query", [100])
    step = q.next_step()
    assert step.lane == 0 and [s.request for s in step.seqs][0] == "query" and step.num_tokens == 100 + 512


def test_a_queries_step_is_topped_up_with_bulk_sequences_that_fit():
    q = LaneQueue(max_batch_tokens=1024, max_batch_seqs=64, query_tokens=256, fill_tokens=512)
    assert q.fill_tokens == 256  # never more than the lane's budget
    q.add("bulk", [100] * 6 + [300])
    q.add("query", [50])
    step = q.next_step()
    assert step.lane == 1 and [s.request for s in step.seqs] == ["query", "bulk", "bulk"]
    assert step.num_tokens == 250 and [s.index for s in step.seqs[1:]] == [0, 1]
    step = q.next_step()  # the bulk request goes on where the queries' step left it
    assert step.lane == 0 and [s.index for s in step.seqs] == [2, 3, 4, 5, 6] and step.num_tokens == 700
    q.add("long", [4000])
    q.add("query", [10])
    step = q.next_step()  # a bulk sequence over the fill budget stays for a bulk step
    assert [s.request for s in step.seqs] == ["query"] and q.bulk.queued_tokens == 4000


def test_without_fill_tokens_a_queries_step_holds_queries_only():
    q = LaneQueue(max_batch_tokens=1024, max_batch_seqs=64, query_tokens=256, fill_tokens=0)
    q.add("bulk", [100] * 8)
    q.add("query", [50])
    assert [s.request for s in q.next_step().seqs] == ["query"]


# --- the loop ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(minilm_folder) -> Engine:
    return Engine(EngineConfig(model_dir=str(minilm_folder), max_batch_tokens=2048, query_tokens=256))


def test_a_query_is_answered_between_the_layers_of_the_bulk_step_in_flight(engine):
    """One bulk step of 2,048 tokens (~1 s on one CPU core): a query submitted once it has
    started is delivered before it ends, and both equal what each computes alone."""
    bulk, query = ids_request(8, 256, seed=1), ids_request(1, 32, seed=2)
    alone_bulk, alone_query = engine.encode([bulk])[0], engine.encode([query])[0]
    order: list[str] = []
    results: dict[str, np.ndarray] = {}
    done = threading.Event()
    layers_seen = []
    loop = EncodeLoop(engine)
    hook = engine.runner.layer_hook
    started = threading.Event()

    def counting_hook() -> None:
        layers_seen.append(time.perf_counter())
        started.set()
        hook()

    engine.runner.layer_hook = counting_hook

    def deliver(name: str, value: np.ndarray) -> None:
        order.append(name)
        results[name] = value.copy()
        if len(order) == 2:
            done.set()

    try:
        loop.submit(Job(bulk, deliver=lambda r: deliver("bulk", r), fail=lambda e: order.append(f"bulk: {e}")))
        assert started.wait(30), "the bulk step never reached its first layer"
        loop.submit(Job(query, deliver=lambda r: deliver("query", r), fail=lambda e: order.append(f"query: {e}")))
        assert done.wait(60), order
    finally:
        loop.stop()
        engine.runner.layer_hook = hook
    layers = engine.spec.hf_config["num_hidden_layers"]
    assert order == ["query", "bulk"], order
    assert len(layers_seen) == layers  # the query's own forward ran unhooked
    assert engine.stats["steps"] >= 2
    np.testing.assert_allclose(results["query"], alone_query, atol=1e-5)
    np.testing.assert_allclose(results["bulk"], alone_bulk, atol=1e-5)


def test_bulk_sequences_carried_by_queries_steps_equal_their_lone_computation(engine):
    """A bulk request larger than one step, queries arriving while it runs: the queries' steps
    carry some of its sequences (fill), and every row, query or bulk, equals its lone value."""
    bulk = ids_request(48, 64, seed=4)  # 3,072 tokens: a 2,048-token step and more queued
    queries = [ids_request(1, 24 + 8 * i, seed=30 + i) for i in range(3)]
    alone_bulk, alone = engine.encode([bulk])[0], [engine.encode([q])[0] for q in queries]
    filled: list[int] = []
    got: dict[str, np.ndarray] = {}
    done, started = threading.Event(), threading.Event()
    loop = EncodeLoop(engine)
    assert loop._queue.fill_tokens == 0  # off on a CPU, where it would only slow queries down
    loop._queue.fill_tokens = 256  # on here to check the rows it carries
    hook, pick = engine.runner.layer_hook, loop._queue.next_query_step

    def counting_pick():
        step = pick()
        if step is not None:
            filled.append(sum(s.request != step.seqs[0].request for s in step.seqs))
        return step

    def deliver(name: str, r: np.ndarray) -> None:
        got[name] = r.copy()
        if len(got) == len(queries) + 1:
            done.set()

    loop._queue.next_query_step = counting_pick
    engine.runner.layer_hook = lambda: (started.set(), hook())
    try:
        loop.submit(Job(bulk, deliver=lambda r: deliver("bulk", r), fail=print))
        assert started.wait(30)
        for i, q in enumerate(queries):
            loop.submit(Job(q, deliver=lambda r, i=i: deliver(f"q{i}", r), fail=print))
        assert done.wait(90), sorted(got)
    finally:
        loop.stop()
        engine.runner.layer_hook = hook
    assert sum(filled) > 0, filled  # some bulk sequences rode in queries' steps
    np.testing.assert_allclose(got["bulk"], alone_bulk, atol=1e-5)
    for i in range(len(queries)):
        np.testing.assert_allclose(got[f"q{i}"], alone[i], atol=1e-5)


def test_an_idle_loop_runs_a_query_at_once_and_queues_everything_else(engine):
    """run_now: a query while the loop sleeps is computed on the caller's thread and equals its
    lone computation; bulk work, or any request while the loop has work, gets None (queue it)."""
    query, bulk = ids_request(1, 40, seed=41), ids_request(8, 256, seed=42)
    alone = engine.encode([query])[0]
    loop = EncodeLoop(engine)
    try:
        deadline = time.monotonic() + 10
        while not loop._idle and time.monotonic() < deadline:  # the loop's thread goes to sleep
            time.sleep(0.01)
        got = loop.run_now(query)
        assert got is not None
        np.testing.assert_allclose(got, alone, atol=1e-5)
        assert loop.throughput.last[0] == 40  # admission's rate follows these steps too
        assert loop.run_now(bulk) is None  # 2,048 tokens: not a query
        hook, started, release = engine.runner.layer_hook, threading.Event(), threading.Event()

        def held_hook() -> None:
            started.set()
            release.wait(30)
            hook()

        engine.runner.layer_hook = held_hook
        done = threading.Event()
        loop.submit(Job(bulk, deliver=lambda r: done.set(), fail=print))
        assert started.wait(30)
        assert loop.run_now(query) is None  # the loop is busy: the query goes through it
        release.set()
        assert done.wait(60)
    finally:
        release.set()
        engine.runner.layer_hook = hook
        loop.stop()


def test_queries_cannot_starve_bulk_work(engine):
    """Queries kept queued back to back, more than the engine serves: the bulk request still
    finishes (at most one query step runs per bulk layer, and the loop never picks two query
    steps in a row while bulk work waits), and every result equals its lone computation."""
    bulk = ids_request(8, 256, seed=3)
    queries = [ids_request(1, 16 + i % 8, seed=10 + i % 8) for i in range(8)]
    alone = [engine.encode([q])[0] for q in queries]
    alone_bulk = engine.encode([bulk])[0]
    bulk_done, stop = threading.Event(), threading.Event()
    got: dict[str, np.ndarray] = {}
    wrong: list[int] = []
    answered = [0]
    outstanding = threading.Semaphore(4)
    loop = EncodeLoop(engine)

    def answer(i: int, r: np.ndarray) -> None:
        if np.abs(r - alone[i]).max() > 1e-5:
            wrong.append(i)
        answered[0] += 1
        outstanding.release()

    def flood() -> None:
        i = 0
        while not stop.is_set():
            if outstanding.acquire(timeout=0.1):
                loop.submit(Job(queries[i % 8], deliver=lambda r, i=i % 8: answer(i, r),
                                fail=lambda e: outstanding.release()))
                i += 1

    feeder = threading.Thread(target=flood, daemon=True)
    try:
        feeder.start()
        time.sleep(0.2)
        loop.submit(Job(bulk, deliver=lambda r: (got.__setitem__("bulk", r.copy()), bulk_done.set()), fail=print))
        finished = bulk_done.wait(90)
    finally:
        stop.set()
        feeder.join(5)
        loop.stop()
    assert finished, "queries starved the bulk request"
    assert answered[0] > 8 and not wrong
    np.testing.assert_allclose(got["bulk"], alone_bulk, atol=1e-5)


# --- on a GPU: the query lane's own buffers and graphs, beside or between eager layers ----------
@pytest.mark.gpu
def test_on_a_gpu_queries_run_between_bulk_layers_and_change_nothing(tmp_path_factory):
    """Qwen3-0.6B shape, bulk steps of 16k tokens (eager, hooked), queries on lane 1 (graphs
    captured and replayed from inside the hook), in turn with the bulk layers on one stream: each
    query, sent one after another while the bulk runs, is delivered before the bulk request, and
    every result equals its lone computation on lane 0."""
    from conftest import qwen3_folders_or_skip

    folder = qwen3_folders_or_skip(tmp_path_factory.mktemp("lane-gpu"), "qwen3-0.6b", "bfloat16")["causal-last"]
    eng = Engine(EngineConfig(model_dir=str(folder), device="cuda:0"))
    assert len(eng.runner.lanes) == 2 and eng.runner.query_lane == 1
    bulk = ids_request(64, 512, seed=5)  # two 16k-token eager steps
    queries = [ids_request(1, 64 + 32 * i, seed=20 + i) for i in range(6)]
    alone_bulk = eng.encode([bulk])[0]
    alone = [eng.encode([q])[0] for q in queries]
    order: list[str] = []
    got: dict[str, np.ndarray] = {}
    all_done = threading.Event()
    loop = EncodeLoop(eng)
    hook, started = eng.runner.layer_hook, threading.Event()

    def signalling_hook() -> None:
        started.set()
        hook()

    def deliver(name: str, r: np.ndarray) -> None:
        order.append(name)
        got[name] = r.copy()
        if len(got) == len(queries) + 1:
            all_done.set()

    eng.runner.layer_hook = signalling_hook
    try:
        for _ in range(3):  # warm-up, capture, replay of the queries' graph keys on lane 1
            for i, q in enumerate(queries):
                ev = threading.Event()
                loop.submit(Job(q, deliver=lambda r, ev=ev: ev.set(), fail=print))
                assert ev.wait(60)
        loop.submit(Job(bulk, deliver=lambda r: deliver("bulk", r), fail=lambda e: order.append(f"bulk: {e}")))
        assert started.wait(60)
        # One query in flight at a time, so each lane-1 step holds one query as its lone computation
        # did: queries sharing a step change the matmuls' M, and with it the kernels' rounding (batch
        # invariance is test_batched_equals_single_on_gpu's to bound).
        for i, q in enumerate(queries):
            ev = threading.Event()
            loop.submit(Job(q, deliver=lambda r, i=i, ev=ev: (deliver(f"q{i}", r), ev.set()),
                            fail=lambda e: order.append(str(e))))
            assert ev.wait(60), order
        assert all_done.wait(120), order
    finally:
        loop.stop()
        eng.runner.layer_hook = hook
    assert order[-1] == "bulk", order
    assert eng.runner.lanes[1].graphs.stats.replays > 0
    assert cosine_rows(got["bulk"], alone_bulk).min() >= 0.9999
    # Cosine, not an absolute bound: raw last-token states of magnitude ~2 round differently in
    # BF16 between the lone computation's eager warm-up and the lane's graph replay (0.078 seen).
    for i, a in enumerate(alone):
        assert cosine_rows(got[f"q{i}"], a).min() >= 0.9999


def test_a_failing_idle_callback_does_not_end_the_loop(engine):
    """The idle metrics flush runs while execute() may answer a query at once; if it raises, the
    loop's thread must live on (every request after it would wait forever otherwise)."""
    calls = threading.Event()

    def failing() -> None:
        calls.set()
        raise RuntimeError("dictionary changed size during iteration")

    loop = EncodeLoop(engine, on_idle=failing)
    try:
        assert calls.wait(10), "the loop never went idle"
        query, done = ids_request(1, 16, seed=3), threading.Event()
        got: list = []
        loop.submit(Job(query, deliver=lambda r: (got.append(r.copy()), done.set()), fail=got.append))
        assert done.wait(30), got
    finally:
        loop.stop()
    np.testing.assert_allclose(got[0], engine.encode([query])[0], atol=1e-5)


def test_idle_time_does_not_count_as_the_next_steps_work(engine):
    """Admission divides queued tokens by the measured tokens/s; work that arrives while the idle
    callback runs must not have the idle seconds booked to its step (a stale clock once measured
    2 tokens/s and refused a 41-token request as 29 s of work)."""
    query, done, got, submitted = ids_request(1, 16, seed=4), threading.Event(), [], threading.Event()

    def submit_when_idle() -> None:
        if not submitted.is_set():
            time.sleep(2.0)  # idle ~3 s in all before the work comes
            submitted.set()
            loop.submit(Job(query, deliver=lambda r: (got.append(r), done.set()), fail=got.append))

    loop = EncodeLoop(engine, on_idle=submit_when_idle)
    try:
        assert done.wait(30), got
        tokens, seconds = loop.throughput.last
    finally:
        loop.stop()
    assert tokens == 16
    assert seconds < 1.5, f"the step's 16 tokens were booked {seconds:.2f} s (the idle time included)"
