"""Packing of queued requests' sequences into token-budgeted steps. No torch here.

Why a token budget: for small embedding models the dense layers' linear cost dominates
attention's quadratic cost, so a step's time follows its token count; once a step holds
enough tokens to saturate the device, packing more sequences does not make it more efficient.

Order: the request with the least work left goes first (ties: arrival order), and within it
sequences go in order; a step stops at the first sequence that does not fit. So a query that
arrives while a bulk request is being encoded takes the next step instead of waiting for the
whole bulk request (a request is no longer the unit of scheduling), and bulk requests of equal
size still finish in arrival order (the one begun has less left). A request larger than the
budget is spread over steps; a sequence longer than the budget runs alone in its own step.

Least work first alone starves: while smaller requests keep coming, a large one never runs and
is dropped at its deadline (two 4-minute CPU soaks of four clients with a 60 s timeout dropped 5
and 4 accepted requests; one with ~9 s of work to go, so after more than 50 s queued; perf/soak.py).
So each step that passes a request over counts its work as 1/AGING of a step budget less: a
request waits for at most about AGING times its own work of requests that came after it, and
least work first holds among requests of similar age.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

AGING = 4  # a request passed over by a step counts max_batch_tokens / AGING tokens less of work


@dataclass(frozen=True)
class Sequence:
    request: Hashable  # the caller's key of the request
    index: int  # row of the sequence inside its request
    start: int  # offset of its first token in the request's flat ids
    length: int


@dataclass
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0
    lane: int = 0  # 0: any work; 1: queries only (LaneQueue)


@dataclass
class _Job:
    key: Hashable
    lengths: list[int]
    arrival: int
    next: int = 0  # first sequence not yet in a step
    start: int = 0  # its token offset
    left: int = 0  # tokens not yet in a step
    passed: int = 0  # steps packed while it waited and took none of its sequences


class WorkQueue:
    """Requests waiting to be encoded; `next_step()` packs the next step from them."""

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int, lane: int = 0) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.lane = lane  # stamped on its steps
        self._jobs: dict[Hashable, _Job] = {}
        self._arrivals = itertools.count()
        self.queued_tokens = 0  # tokens of every request not yet in a step
        self._credit = max(1, max_batch_tokens // AGING)  # tokens of work forgiven per step passed over

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(self, key: Hashable, lengths: list[int]) -> None:
        if key in self._jobs:
            raise KeyError(f"request {key!r} is already queued")
        job = _Job(key, [int(n) for n in lengths], next(self._arrivals))
        job.left = sum(job.lengths)
        self._jobs[key] = job
        self.queued_tokens += job.left

    def remove(self, key: Hashable) -> None:
        """Drop a request's sequences that are not yet in a step (cancelled, past its deadline)."""
        job = self._jobs.pop(key, None)
        if job is not None:
            self.queued_tokens -= job.left

    def keys(self) -> list[Hashable]:
        return list(self._jobs)

    def _order(self, job: _Job) -> tuple[int, int]:
        """Least work left first, less what waiting has earned (AGING); ties in arrival order."""
        return job.left - job.passed * self._credit, job.arrival

    def _in_order(self) -> list[_Job]:
        return sorted(self._jobs.values(), key=self._order)

    def work_ahead(self, tokens: int) -> int:
        """Queued tokens that would run before a new request of `tokens` tokens (least work
        first, with aging): what such a request waits for, besides the step in flight."""
        return sum(job.left for job in self._jobs.values() if self._order(job)[0] <= tokens)

    def finish_lines(self) -> dict[Hashable, int]:
        """Per queued request, the tokens that run before its last sequence (its own included)."""
        out, total = {}, 0
        for job in self._in_order():
            total += job.left
            out[job.key] = total
        return out

    def next_step(self) -> Step | None:
        if not self._jobs:
            return None
        step = self.top_up(Step(lane=self.lane), self.max_batch_tokens)
        taken = {s.request for s in step.seqs}
        for job in self._jobs.values():
            if job.key not in taken:
                job.passed += 1
        return step

    def top_up(self, step: Step, max_tokens: int) -> Step:
        """Add this queue's next sequences to `step` (in the usual order) while they fit in
        `max_tokens` and max_batch_seqs; a step that is empty takes its first sequence whatever
        its length."""
        for job in self._in_order():
            if not self._take(job, step, max_tokens):
                break
        return step

    def _take(self, job: _Job, step: Step, max_tokens: int) -> bool:
        """Move `job`'s sequences into `step` while they fit; False once the step is full."""
        while job.next < len(job.lengths):
            n = job.lengths[job.next]
            if len(step.seqs) >= self.max_batch_seqs or (step.seqs and step.num_tokens + n > max_tokens):
                return False
            step.seqs.append(Sequence(job.key, job.next, job.start, n))
            step.num_tokens += n
            job.next, job.start, job.left = job.next + 1, job.start + n, job.left - n
            self.queued_tokens -= n
        del self._jobs[job.key]
        return True

    def steps(self) -> Iterator[Step]:
        while (step := self.next_step()) is not None:
            yield step


class LaneQueue:
    """Queries apart from bulk work: requests of at most `query_tokens` tokens wait in a queue of
    their own, whose steps are small (a CUDA graph of a few milliseconds) and taken first. Bulk
    steps keep the full budget, so bulk throughput does not shrink to make room for queries;
    instead a query's step runs between two layers of the bulk step in flight (engine/loop.py).
    Without `query_tokens` it is one WorkQueue, as before.

    With `fill_tokens`, a queries' step is topped up with bulk sequences: a step of a few hundred
    tokens costs nearly as much GPU time as one of two thousand (the weights are read either way),
    so the bulk sequences it carries cost little. Measured through the server it is a trade, off
    by default: bulk keeps more of its throughput, but queries wait for the larger steps
    (perf/results/2026-12-04-43e5651/NOTES.md)."""

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int, query_tokens: int = 0,
                 fill_tokens: int = 0) -> None:
        self.bulk = WorkQueue(max_batch_tokens, max_batch_seqs)
        self.query_tokens = min(query_tokens, max_batch_tokens)
        self.queries = WorkQueue(self.query_tokens, max_batch_seqs, lane=1) if query_tokens else None
        self.fill_tokens = min(fill_tokens, self.query_tokens)

    def __bool__(self) -> bool:
        return bool(self.bulk) or self.has_queries

    @property
    def has_queries(self) -> bool:
        return self.queries is not None and bool(self.queries)

    @property
    def queued_tokens(self) -> int:
        return self.bulk.queued_tokens + (self.queries.queued_tokens if self.queries is not None else 0)

    def is_query(self, tokens: int) -> bool:
        return self.queries is not None and tokens <= self.query_tokens

    def add(self, key: Hashable, lengths: list[int]) -> None:
        (self.queries if self.is_query(sum(lengths)) else self.bulk).add(key, lengths)

    def remove(self, key: Hashable) -> None:
        self.bulk.remove(key)
        if self.queries is not None:
            self.queries.remove(key)

    def keys(self) -> list[Hashable]:
        return self.bulk.keys() + (self.queries.keys() if self.queries is not None else [])

    def work_ahead(self, tokens: int) -> int:
        """Queued tokens that run before a new request of `tokens` tokens: a query waits only for
        queries (it slips between bulk layers), bulk work for every query and the smaller bulk."""
        if self.is_query(tokens):
            return self.queries.work_ahead(tokens)
        return self.bulk.work_ahead(tokens) + (self.queries.queued_tokens if self.queries is not None else 0)

    def finish_lines(self) -> dict[Hashable, int]:
        if self.queries is None:
            return self.bulk.finish_lines()
        first = self.queries.queued_tokens
        return self.queries.finish_lines() | {k: v + first for k, v in self.bulk.finish_lines().items()}

    def next_query_step(self) -> Step | None:
        """Queries (up to `query_tokens`), then bulk sequences while the step is under `fill_tokens`."""
        step = self.queries.next_step() if self.queries is not None else None
        if step is not None and self.fill_tokens > step.num_tokens:
            self.bulk.top_up(step, self.fill_tokens)
        return step

    def next_step(self) -> Step | None:
        """The next step: queries' first, else bulk work."""
        return self.next_query_step() if self.has_queries else self.bulk.next_step()
