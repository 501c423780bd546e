"""EncodeLoop: the engine's own thread, taking requests as they arrive, one step at a time.

Why: with Triton handing the encoder a batch of requests per `execute()` and the engine running all
their steps before returning, the request was the unit of scheduling: a query that arrived meanwhile
waited in Triton's queue behind every bulk request already taken. Here `execute()` only queues
requests (the Python backend's response sender answers them later) and this thread packs every step
from all queued requests (engine/scheduler.py: least work left first), so a query waits for at most
the step in flight, and with the query lane (`query_tokens`) about one layer of it: its step runs
between two layers of the bulk step (`_between_layers`; perf/results/2026-12-04-c60177f/NOTES.md).
Run in turn, each query costs the bulk work about its whole batch-1 forward, which leaves most SMs
idle. Between steps it also drops requests whose client has gone (a cancelled gRPC call, or a
request past its own `timeout`), and `submit()` refuses new work at once when the queued work would
take longer than `max_queue_seconds` at the measured throughput (but for work the gateway admitted,
which weighed it before any work), or than the request's own timeout: load is shed by work, not by
request count.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pergola.engine import EncodeRequest, Engine, file_rows
from pergola.engine.lazy import LazyTensor
from pergola.engine.scheduler import LaneQueue, Step
from pergola.memory import HeapTrimmer

log = logging.getLogger("pergola.engine")

CANCEL_CHECK_S = 0.05  # how often a queued request's "client gone?" is asked (an IPC to the server)
# Layers the host may launch ahead of the device in a bulk step while queries are served between
# layers: a query's step waits for about this many layers of a full-budget step.
LAYERS_AHEAD = 1
# ... except in a bulk step's last layers: there the host runs ahead, so that packing the next
# step (gather, copy, plan: a few ms for 16k tokens) overlaps the device's last layers instead of
# leaving it idle (bulk alone ran slower with the host held back on every layer,
# perf/results/2026-12-04-c60177f/NOTES.md).
FREE_LAST_LAYERS = 3


class Overloaded(RuntimeError):
    """Refused at the door: the queued work is over its limit (retry later, elsewhere)."""


class Cancelled(RuntimeError):
    """The client went away (cancelled call, or past its timeout) before the result was ready."""


class Unloading(RuntimeError):
    """The model is being unloaded: the request was not computed."""


@dataclass(eq=False)
class Job:
    """One request in the loop, with what to call when it is done."""

    request: EncodeRequest
    deliver: Callable[[np.ndarray], None]  # the [n, out_dim] result, called from the loop thread
    fail: Callable[[BaseException], None]
    cancelled: Callable[[], bool] = lambda: False
    deadline: float | None = None  # time.monotonic() after which the client no longer waits
    admitted: bool = False  # the gateway admitted it (pergola.triton.adapter.admitted): only its deadline refuses it
    result: np.ndarray = field(init=False)
    rows_left: int = field(init=False)
    checked_at: float = 0.0
    queued_at: float = field(default_factory=time.perf_counter)  # metrics: queue wait = started_at - queued_at
    started_at: float = 0.0  # when its first sequence went into a step


class Throughput:
    """Tokens per second while busy, over the last `window` steps. A window rather than a
    per-step rate: with steps pipelined (and run synchronously on a CPU) the time between two
    collections belongs to one step or the next, which averages out only over several."""

    def __init__(self, window: int = 16) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, tokens: int, seconds: float) -> None:
        self._steps.append((tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        seconds = sum(s for _, s in self._steps)
        return sum(t for t, _ in self._steps) / seconds if seconds > 0 else None

    @property
    def last(self) -> tuple[int, float] | None:
        """(tokens, busy seconds) of the latest step (metrics)."""
        return self._steps[-1] if self._steps else None


class EncodeLoop:
    def __init__(self, engine: Engine, max_queue_seconds: float = 0.0,
                 on_step: Callable[[], None] | None = None, on_idle: Callable[[], None] | None = None,
                 on_fatal: Callable[[BaseException], bool] | None = None) -> None:
        """on_step: after each step; on_idle: once the loop has been idle for a second (both
        from the loop's thread: metrics). on_fatal(error) -> True when the error poisoned the
        device: every job fails and the loop ends (the adapter then ends its process)."""
        self.engine = engine
        self.max_queue_seconds = max_queue_seconds
        self.on_step = on_step or (lambda: None)
        self.on_idle = on_idle or (lambda: None)
        self.on_fatal = on_fatal or (lambda e: False)
        self.throughput = Throughput()
        self.completed: list[Job] = []  # the jobs the latest step finished
        cfg = engine.cfg
        # Filling queries' steps pays only on a GPU: on a CPU a step's time grows with its tokens from the first.
        fill = cfg.query_fill_tokens if engine.device.type == "cuda" else 0
        self._queue = LaneQueue(cfg.step_tokens, cfg.max_batch_seqs, cfg.query_tokens, fill)
        # Queries' steps in flight beside the main pipeline, oldest first (at most two: their lane
        # has two result buffers), and the events that keep the host close behind the device.
        self._side: deque[tuple[Step, LazyTensor]] = deque()
        self._layer_events: deque = deque()
        self._query_last = False  # the last step the loop itself picked was a queries' step
        self._idle = False  # asleep with nothing queued or in flight (run_now may use the device)
        self.answered_at_once = 0  # queries run_now computed
        self._layers = int(engine.spec.hf_config.get("num_hidden_layers") or 0)
        self._layer = 0  # layers of the bulk step in flight launched so far
        self._jobs: dict[int, Job] = {}
        self._keys = itertools.count()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy_since = time.perf_counter()
        # Host memory freed by steps of varying shapes is given back every few seconds of work
        # and when the queue runs dry (pergola/memory.py); a token counts as 4 KB of churn.
        self._trimmer = HeapTrimmer(every_bytes=256 << 20, every_s=10.0)
        self._measure()
        if cfg.query_tokens:
            engine.runner.layer_hook = self._between_layers
        self._thread = threading.Thread(target=self._run, name="pergola-encode-loop", daemon=True)
        self._thread.start()

    # --- the door (Triton's execute thread) ---------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job`, or raise Overloaded at once when it should not wait."""
        tokens = int(job.request.input_ids.size)
        job.result = np.empty((job.request.lengths.size, self.engine.runner.out_dim), dtype=np.float32)
        job.rows_left = int(job.request.lengths.size)
        with self._cond:
            if self._stopping:
                raise Unloading("the model is being unloaded; retry (another replica, or after the reload)")
            self._admit(job, tokens)
            key = next(self._keys)
            self._jobs[key] = job
            self._queue.add(key, job.request.lengths.tolist())
            self._cond.notify()

    def run_now(self, request: EncodeRequest) -> np.ndarray | None:
        """A query while the loop is idle, computed at once on the caller's thread -> its
        [n, out_dim] result; None (nothing done) when the loop has work or the request is not a
        query: then submit() it.

        Why: handing a lone query to the loop's thread and answering it from there costs a
        thread hand-off and a response sender's round trip on every idle request, which batch-1
        latency through Triton showed (perf/results/2026-12-04-43e5651/NOTES.md). Safe without a
        lock around the compute because the caller (the adapter's execute()) is the only thread
        that submits: while it computes here, nothing new reaches the queue, and the sleeping loop
        has nothing to run."""
        with self._cond:
            if not self._idle or self._queue or self._stopping or not self._queue.is_query(int(request.input_ids.size)):
                return None
        self.answered_at_once += 1
        t0 = time.perf_counter()
        if self.engine.device.type != "cuda":
            result = self.engine.encode([request], lane=self.engine.runner.query_lane)[0]
        else:
            with torch.cuda.device(self.engine.device):
                result = self.engine.encode([request], lane=self.engine.runner.query_lane)[0]
        with self._cond:  # admission's throughput follows these steps too, not only the loop's
            self.throughput.add(int(request.input_ids.size), time.perf_counter() - t0)
        return result

    def _admit(self, job: Job, tokens: int) -> None:
        """Refuse a request whose wait would pass max_queue_seconds (unless the gateway admitted
        it: pergola.triton.adapter.admitted) or its own deadline. Its wait is the work that runs
        before it (least work first): a query is not refused because bulk work is queued, only
        if it could not be served in time itself."""
        rate, ahead = self.throughput.tokens_per_s, self._queue.work_ahead(tokens)
        if rate is None or ahead == 0:
            return  # nothing measured yet, or nothing ahead of it: always take the work
        wait = (ahead + tokens) / rate
        if self.max_queue_seconds and wait > self.max_queue_seconds and not job.admitted:
            raise Overloaded(f"this request would wait behind {ahead:,} queued tokens, about {wait:.1f} s at "
                             f"{rate:,.0f} tokens/s, over the limit of {self.max_queue_seconds:g} s "
                             "(max_queue_seconds): retry later or on another replica")
        if job.deadline is not None and time.monotonic() + wait > job.deadline:
            raise Overloaded(f"this request would wait behind {ahead:,} queued tokens, about {wait:.1f} s, past "
                             "its own timeout: retry later, or with a longer timeout")

    def _measure(self) -> None:
        """Seed the throughput with two full steps of a dummy batch (the first warms up),
        so that admission works from the first request of a flood. On the CPU, quarter steps: a
        step's tokens per second hardly depend on its size there, and two full steps took seconds
        of every start and of every reload after a crash (pergola/triton/supervisor.py)."""
        budget, length = self.engine.cfg.step_tokens, min(128, self.engine.spec.max_seq_length)
        if self.engine.device.type != "cuda":
            budget = max(length, budget // 4)
        count = max(1, min(budget // length, self.engine.cfg.max_batch_seqs))
        dummy = EncodeRequest(np.zeros(count * length, np.int64), np.full(count, length, np.int32))
        for _ in range(2):
            t0 = time.perf_counter()
            self.engine.encode([dummy])
            seconds = time.perf_counter() - t0
        self.throughput.add(count * length, seconds)
        self.engine.stats.clear()  # not traffic

    def queued_tokens(self) -> int:
        with self._cond:
            return self._queue.queued_tokens

    def stop(self) -> None:
        """Finish the step in flight, fail what is still queued (Unloading), end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=60)

    # --- the loop thread ----------------------------------------------------------------
    def _run(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)  # the current device is per thread
        inflight: tuple[Step, LazyTensor] | None = None

        def woken() -> bool:
            return bool(self._queue) or self._stopping

        while True:
            if inflight is None and not self._side and not self._wait(woken, timeout=1.0):
                self._rest(woken)
            with self._cond:
                if self._stopping and inflight is None and not self._side:
                    leftover = list(self._jobs.values())
                    self._jobs.clear()
                    break
                gone = [] if self._stopping else self._expire()
                step = None if self._stopping else self._pick()
                requests = self._requests_of(step)
            for job, error in gone:
                job.fail(error)
            if step is not None and step.lane == 1:
                self._launch_query(step, requests)
                continue
            try:
                launched = (step, self._launch(step, requests)) if step else None
                if inflight is not None:
                    self._collect(*inflight)
            except Exception as e:  # noqa: BLE001 - fail the steps' requests, keep serving
                if self._failed(e, [st for st in (step, inflight and inflight[0]) if st is not None]):
                    return
                launched = None
            inflight = launched
            self._collect_queries(block=inflight is None)
        for job in leftover:
            job.fail(Unloading("the model was unloaded before this request was computed; retry"))

    def _rest(self, woken: Callable[[], bool]) -> None:
        """Idle for a second: give the heap back, tell the metrics (again after queries run_now
        answered), until there is work; then restart the work clock. Here, not only in `_wait`:
        work that arrives while a callback runs finds `woken()` true at once, and the idle time
        must not count as the next step's (once it did, admission read a near-zero rate and refused)."""
        self._trimmer.now()
        self._idle_callback()
        answered = self.answered_at_once
        while not self._wait(woken, timeout=1.0):
            if self.answered_at_once != answered:
                answered = self.answered_at_once
                self._idle_callback()
        self._busy_since = time.perf_counter()  # idle time is not work time

    def _pick(self) -> Step | None:
        """The next step (lock held): queries' first, but never twice in a row while bulk work
        waits (more queries run between its layers), nor with two queries' steps in flight."""
        queue = self._queue
        take_query = queue.has_queries and len(self._side) < 2 and not (self._query_last and queue.bulk)
        if not take_query and queue.has_queries and not queue.bulk:
            return None  # only queries, two in flight: collect one first
        self._query_last = take_query
        return queue.next_query_step() if take_query else queue.bulk.next_step()

    def _requests_of(self, step: Step | None) -> dict:
        """The step's requests by key; marks when each started (called with the lock held)."""
        if step is None:
            return {}
        requests = {s.request: self._jobs[s.request].request for s in step.seqs}
        for key in requests:
            self._jobs[key].started_at = self._jobs[key].started_at or time.perf_counter()
        return requests

    def _launch(self, step: Step, requests: dict) -> LazyTensor:
        """A bulk step: queries may be served between its layers (`_between_layers`)."""
        self._layer_events.clear()
        self._layer = 0
        return self.engine.launch(step, requests, hooked=True)

    # --- the query lane ---------------------------------------------------------------
    def _launch_query(self, step: Step, requests: dict) -> None:
        """Launch a queries' step on the runner's query lane, beside the main pipeline; it is
        collected as soon as it is done (`_collect_queries`), not behind the bulk step."""
        try:
            self._side.append((step, self.engine.launch(step, requests, lane=self.engine.runner.query_lane)))
        except Exception as e:  # noqa: BLE001 - fail the step's requests, keep serving
            if self._failed(e, [step]):
                raise

    def _collect_queries(self, block: bool = False) -> None:
        """Deliver the queries' steps that are done (all of them, waiting, when `block`)."""
        while self._side and (block or self._side[0][1].ready()):
            step, lazy = self._side.popleft()
            try:
                self._collect(step, lazy)
            except Exception as e:  # noqa: BLE001
                self._failed(e, [step])

    def _between_layers(self) -> None:
        """Called by the runner after each layer of a bulk step (launched, not yet run).

        Keeps the host at most LAYERS_AHEAD layers ahead of the device (but for the step's last
        FREE_LAST_LAYERS), so that a query's step launched here runs after about that many layers
        instead of after the whole bulk step, and the host sees new
        queries within about a layer;
        delivers the queries' steps that are done, and launches the next one (one at a time,
        and at most one per bulk layer, so queries cannot starve bulk work)."""
        self._layer += 1
        if self._side:
            self._collect_queries(block=True)  # launched a layer ago: it is next on the device
        elif self.engine.device.type == "cuda" and self._layer < self._layers - FREE_LAST_LAYERS:
            event = torch.cuda.Event()
            event.record()
            self._layer_events.append(event)
            if len(self._layer_events) > LAYERS_AHEAD:
                self._layer_events.popleft().synchronize()
        if not self._queue.has_queries or self._stopping:
            return
        with self._cond:
            step = self._queue.next_query_step()
            requests = self._requests_of(step)
        if step is not None:
            self._launch_query(step, requests)
            self._collect_queries()  # on a CPU it is done already

    def _wait(self, woken: Callable[[], bool], timeout: float | None = None) -> bool:
        """Sleep until there is work (or shutdown); False if `timeout` passed first."""
        with self._cond:
            if woken():
                return True
            self._idle = True
            try:
                if not self._cond.wait_for(woken, timeout=timeout):
                    return False
            finally:
                self._idle = False
            self._busy_since = time.perf_counter()  # idle time is not work time
            return True

    def _expire(self) -> list[tuple[Job, BaseException]]:
        """Drop queued jobs whose client is gone, or that can no longer finish before their
        deadline at the measured throughput (called with the lock held)."""
        now = time.monotonic()
        rate = self.throughput.tokens_per_s
        finish = self._queue.finish_lines() if rate else {}
        gone = []
        for key, job in list(self._jobs.items()):
            if job.deadline is not None and now > job.deadline:
                gone.append((key, job, Cancelled("the request's timeout passed before it was computed")))
            elif job.deadline is not None and key in finish and now + finish[key] / rate > job.deadline:
                gone.append((key, job, Cancelled(f"the request cannot finish before its timeout "
                                                 f"({finish[key]:,} tokens to go at {rate:,.0f} tokens/s); retry")))
            elif now - job.checked_at >= CANCEL_CHECK_S:
                job.checked_at = now
                if job.cancelled():
                    gone.append((key, job, Cancelled("the request was cancelled by its client")))
        for key, _, _ in gone:
            self._queue.remove(key)
            del self._jobs[key]
        return [(job, error) for _, job, error in gone]

    def _collect(self, step: Step, lazy: LazyTensor) -> None:
        """Wait for `step`, file its rows, deliver the requests it completed."""
        values = lazy.wait()  # [num_seqs, out_dim] host view, valid until the buffer is reused
        now = time.perf_counter()
        self.throughput.add(step.num_tokens, now - self._busy_since)
        self._busy_since = now
        done = []
        with self._cond:
            file_rows(step, lazy, lambda key: getattr(self._jobs.get(key), "request", None))
            for row, s in enumerate(step.seqs):
                job = self._jobs.get(s.request)
                if job is None:
                    continue  # cancelled while its step ran
                job.result[s.index] = values[row]
                job.rows_left -= 1
                if job.rows_left == 0:
                    done.append(self._jobs.pop(s.request))
        self.engine.stats.update(requests=len(done))
        for job in done:
            job.deliver(job.result)
        self.completed = done  # (metrics: their queue waits)
        self.on_step()
        self._trimmer.after(step.num_tokens * 4096)

    def _take_jobs(self, step: Step) -> list[Job]:
        with self._cond:
            jobs = {s.request: self._jobs.pop(s.request) for s in step.seqs if s.request in self._jobs}
            for key in jobs:
                self._queue.remove(key)
        return list(jobs.values())

    def _idle_callback(self) -> None:
        """on_idle (the metrics' flush), which must never end the loop's thread: every request
        after that would wait forever. (It runs while execute() may answer a query at once.)"""
        try:
            self.on_idle()
        except Exception:  # noqa: BLE001 - reported, and the loop goes on
            log.exception("the encode loop's idle callback failed; serving on")

    def _failed(self, error: BaseException, steps: list[Step]) -> bool:
        """Fail the jobs of `steps` (all jobs when the device is poisoned); True: end the loop."""
        fatal = self.on_fatal(error)
        if fatal:
            with self._cond:
                jobs = list(self._jobs.values())
                self._jobs.clear()
                self._stopping = True
        else:
            jobs = [job for step in steps for job in self._take_jobs(step)]
        for job in jobs:
            job.fail(error)
        return fatal
