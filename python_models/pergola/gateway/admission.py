"""Admission: a request's work is weighed against the work in flight before any of it is done.

Why: refused after the work, a request costs nearly what an answered one does: under a flood
each refusal came only after its texts were tokenized, the few accepted requests waited past the
encoder's queue bound, and a refused request's other chunks were computed anyway
(perf/results/2026-12-06-a3538ba-cpu/NOTES.md). Here the gateway says yes or no first.

Work is counted in tokens, the engine's unit (a step costs per token, engine/scheduler.py):
- before tokenizing it is estimated from characters: each input's characters over the model's
  characters per token, learned from answers (an input answered with far fewer tokens than its
  characters predict was cut at the model's limit: it is left out of the ratio, and the largest
  such count caps every input's estimate); token ids count exactly; a request with `chunking`
  counts its windows (Load.windowed: the tokens neighbouring windows share, and each window's
  special tokens), and once they are cut, their exact tokens (Ticket.resize);
- throughput is measured here, from answered calls: bulk tokens answered per second of the time
  this process had bulk work of that model in flight (busy time), over the last WINDOW_S of it.
  Queries are left out: their time is round trips, not throughput.

For a request of `own` tokens, with `ahead` tokens accepted before it and not yet answered (for a
query, the queries only: the encoder serves them in a lane of their own, LaneQueue in
engine/scheduler.py), `rate` the measured throughput and `bound` the queue bound (--queue-bound-s,
else the model's max_queue_seconds, the encoder's own bound):
- 413 naming --request-timeout-s when own / (the best rate measured) > PLAN x the request
  timeout: it cannot be expected to finish in time even on an idle server;
- accepted when nothing is ahead or (ahead + own) / rate <= PLAN x bound: it should be answered
  within `bound` of its arrival;
- accepted when own / rate > PLAN x bound (larger than the bound on its own) while ahead / rate
  and (ahead + own) / rate are within PLAN of the bound and of the request timeout: the queue bound
  is about waiting behind others, and its own compute is bounded by the request timeout;
- otherwise 429, Retry-After the seconds until enough of the backlog is done for it to fit.
Until MIN_TOKENS of bulk work have been answered (no rate yet), bulk work is accepted while at most
SEED_TOKENS are in flight, or when nothing is.

Several worker processes (--gateway-workers) each admit against their own work in flight and
their own measured throughput. uvicorn spreads connections over them, so under load each carries
its share of the work and is answered at its share of the encoder's throughput: its in-flight work
over its rate is the wait one process would compute for the whole. When load moves between workers
faster than WINDOW_S, a worker's estimate is off for a while; what it admits meanwhile is still
bounded by the request timeout (the encoder drops work that cannot finish by its deadline: 504).

Admitted work is marked (pergola.triton.adapter.ADMITTED): the encoder then does not refuse it for its
queue (which would count the request's own chunks as work ahead of it), only for its deadline.
The best rate measured is what a 413 is judged by; a cold start's slow first answers (a GPU
capturing its graphs) can, until faster ones come, refuse a request that would just fit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import GatewayError
from pergola.text.chunking import window_count

WINDOW_S = 10.0  # busy seconds of answered bulk calls the throughput is measured over
MIN_TOKENS = 4_096  # bulk tokens answered before the measured throughput is trusted
SEED_TOKENS = 16_384  # bulk tokens accepted in flight at once until then (one GPU step)
CHARS_PER_TOKEN = 4.0  # the ratio until answers say (English prose through BPE or WordPiece: ~4-5)
PRIOR_TOKENS = 256.0  # ...weighted as this many tokens; later answers outweigh it
DECAY = 0.98  # each answer keeps this share of the ratio's earlier weight: it follows the traffic
CUT = 2.0  # an input answered with fewer tokens than its characters / (CUT x ratio) was cut short
SPECIAL_TOKENS = 2  # added to each input's estimate ([CLS] ... [SEP], <s> ... </s>)
DEFAULT_LIMIT = 512  # a model's token limit, until an input cut short shows it (Load.cap)
# Work is admitted to finish by this share of the queue bound (and of the request timeout): the
# throughput is measured, not known, and the gateway's own refusals take CPU from the encoder on a
# small host. Planned to the whole bound (or to 0.9 of it), the accepted p99 overshot the bound
# under floods; planned to 0.8 it kept within (perf/results/2026-12-06-a3538ba-cpu/NOTES.md).
PLAN = 0.8


class Rate:
    """Tokens answered per second of busy time (bulk work in flight), over the last WINDOW_S of it.

    Why busy time: under load the encoder never idles and answered tokens over wall time is its
    throughput; between bursts the idle time would count as slowness. The window runs from the
    last answer older than WINDOW_S (its tokens were computed before: not counted) to the latest,
    so answers further apart than the window (one long request at a time) still read right, and
    a long call still in flight does not decay the rate."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self.open = 0  # bulk requests in flight
        self.busy_s = 0.0  # busy time before the current busy period
        self.since = 0.0  # when the current busy period began
        self.origin = 0.0  # busy clock of the answer the window starts after (0: the first busy moment)
        self.samples: deque[tuple[float, int]] = deque()  # (busy clock at the answer, tokens), after origin
        self.best: float | None = None  # the highest trusted rate so far (413: "even alone")

    def busy_now(self) -> float:
        return self.busy_s + (self.clock() - self.since if self.open else 0.0)

    def begin(self) -> None:
        if self.open == 0:
            self.since = self.clock()
        self.open += 1

    def end(self) -> None:
        self.open -= 1
        if self.open == 0:
            self.busy_s += self.clock() - self.since

    def add(self, tokens: int) -> None:
        at = self.busy_now()
        self.samples.append((at, tokens))
        while len(self.samples) > 1 and self.samples[0][0] < at - self.window_s:
            self.origin = self.samples.popleft()[0]
        rate = self.tokens_per_s
        if rate is not None:
            self.best = max(self.best or 0.0, rate)

    @property
    def tokens_per_s(self) -> float | None:
        """None until MIN_TOKENS have been answered in the window."""
        if not self.samples:
            return None
        tokens, span = sum(t for _, t in self.samples), self.samples[-1][0] - self.origin
        return tokens / span if tokens >= MIN_TOKENS and span > 0 else None


@dataclass
class Load:
    """One model's (one encoder's) work from this process."""

    lanes: list[int] = field(default_factory=lambda: [0, 0])  # tokens accepted, not answered: queries, bulk
    rate: Rate = field(default_factory=Rate)
    chars: float = CHARS_PER_TOKEN * PRIOR_TOKENS  # decayed sums of the ratio's answers
    tokens: float = PRIOR_TOKENS
    cap: int | None = None  # the most tokens an input was seen cut to (the model's limit)

    @property
    def chars_per_token(self) -> float:
        return self.chars / self.tokens

    def estimate(self, chars: Sequence[int]) -> int:
        """Tokens of inputs of `chars` characters each."""
        return estimate(chars, self.chars_per_token, self.cap)

    def windowed(self, chars: Sequence[int], size: int | None, overlap: int) -> int:
        """Tokens encoded for inputs of `chars` characters cut into windows of `size` text tokens
        (None: the model's limit, as far as answers have shown it) sharing `overlap` (chunking,
        pergola.text.chunking): every window's tokens, its shared ones and special tokens included."""
        size = size or (self.cap or DEFAULT_LIMIT) - SPECIAL_TOKENS
        total = 0
        for c in chars:
            n = math.ceil(c / self.chars_per_token)
            windows = window_count(n, size, min(overlap, size - 1))
            total += n + (windows - 1) * overlap + windows * SPECIAL_TOKENS
        return total

    def learn(self, chars: Sequence[int], tokens: Sequence[int]) -> None:
        """The ratio and the cap from an answer: `tokens` of inputs of `chars` characters."""
        limit = CUT * self.chars_per_token
        kept_chars = kept_tokens = 0
        for c, t in zip(chars, tokens):
            if c > limit * max(t, 1):  # cut short at the model's limit
                self.cap = max(self.cap or 0, t)
            else:
                kept_chars, kept_tokens = kept_chars + c, kept_tokens + t
        self.chars = self.chars * DECAY + kept_chars
        self.tokens = self.tokens * DECAY + kept_tokens


def estimate(chars: Sequence[int], chars_per_token: float, cap: int | None) -> int:
    """Tokens of inputs of `chars` characters each (plain Python: a query's one text costs ~1 us,
    where numpy's calls on a short array cost tens)."""
    cap = cap or 1 << 62
    return sum(min(math.ceil(c / chars_per_token) + SPECIAL_TOKENS, cap) for c in chars)


def lengths(texts: Sequence[str]) -> list[int]:
    """Characters of each text."""
    return list(map(len, texts))


class Ticket:
    """One accepted request: its work counts as in flight until answered or closed."""

    def __init__(self, load: Load, lane: int, tokens: int, deadline: float) -> None:
        self.load, self.lane, self.left, self.deadline = load, lane, tokens, deadline
        self.ratio, self.cap = load.chars_per_token, load.cap  # (a part's estimate, as when admitted)
        load.lanes[lane] += tokens
        if lane:
            load.rate.begin()

    def left_s(self) -> float:
        """Seconds left before the request's timeout."""
        return self.deadline - time.monotonic()

    def estimate(self, chars: Sequence[int]) -> int:
        """Tokens of a part of inputs of `chars` characters, as estimated when it was admitted."""
        return estimate(chars, self.ratio, self.cap)

    def answered(self, chars: Sequence[int] | None, tokens: np.ndarray) -> None:
        """A part of the request answered: `tokens` per input (of `chars` characters; None for ids)."""
        counts = tokens.ravel().tolist() if isinstance(tokens, np.ndarray) else list(tokens)
        done = sum(counts)
        part = done if chars is None else self.estimate(chars)
        self._release(min(part, self.left))
        if chars is not None:
            self.load.learn(chars, counts)
        if self.lane:
            self.load.rate.add(done)

    def resize(self, tokens: int) -> None:
        """The request's work left is now known to be `tokens` (its windows cut, none encoded yet)."""
        self.load.lanes[self.lane] += tokens - self.left
        self.left = tokens

    def _release(self, tokens: int) -> None:
        self.left -= tokens
        self.load.lanes[self.lane] -= tokens

    def close(self) -> None:
        self._release(self.left)
        if self.lane:
            self.load.rate.end()
            self.lane = 0  # (closed once)


class Admission:
    """Per model: the work accepted and not yet answered, its measured throughput, and the
    decision for each new request (module docstring)."""

    def __init__(self, timeout_s: float, queue_bound_s: float = 0.0) -> None:
        self.timeout_s, self.queue_bound_s = timeout_s, queue_bound_s
        self.loads: dict[str, Load] = {}

    def load(self, model: ServedModel) -> Load:
        load = self.loads.get(model.target)
        if load is None:
            load = self.loads[model.target] = Load()
        return load

    def bound_s(self, model: ServedModel) -> float:
        """The queue bound: --queue-bound-s, else the model's max_queue_seconds (0: none)."""
        return self.queue_bound_s or float(model.limit("max_queue_seconds"))

    def admit(self, model: ServedModel, chars: Sequence[int] | None = None, tokens: int | None = None,
              windows: tuple[int | None, int] | None = None) -> Ticket:
        """A ticket for a request of inputs of `chars` characters (or of exactly `tokens` tokens;
        or, with `windows` (size, overlap), cut into windows: Load.windowed), or GatewayError 429 /
        413 before any of its work is done."""
        load = self.load(model)
        if windows is not None:
            own = load.windowed(chars, *windows)  # type: ignore[arg-type]
        else:
            own = tokens if tokens is not None else load.estimate(chars)  # type: ignore[arg-type]
        query_tokens = int(model.limit("query_tokens"))
        lane = 0 if query_tokens and own <= query_tokens else 1
        ahead = load.lanes[0] if lane == 0 else sum(load.lanes)
        wait = self._refusal(model, load, own, ahead, lane)
        if wait is not None:
            raise wait
        return Ticket(load, lane, own, time.monotonic() + self.timeout_s)

    def _refusal(self, model: ServedModel, load: Load, own: int, ahead: int, lane: int) -> GatewayError | None:
        rate, best = load.rate.tokens_per_s, load.rate.best
        if best is not None and own / best > PLAN * self.timeout_s:
            return GatewayError(413, f"this request is about {own:,} tokens of work, about {own / best:,.0f} s at "
                                     f"the most this model was measured to do ({best:,.0f} tokens/s), more than "
                                     f"{PLAN:.0%} of the request timeout of {self.timeout_s:g} s "
                                     "(--request-timeout-s): raise it, or split the request")
        if ahead == 0:
            return None
        if rate is None:  # not measured yet: a seed budget of bulk work (queries always pass)
            if lane == 0 or ahead + own <= SEED_TOKENS:
                return None
            return _busy(f"{ahead:,} tokens of work are in flight for this model and its throughput is not "
                         "measured yet", 1)
        bound = self.bound_s(model)
        planned, finish = PLAN * bound, (ahead + own) / rate
        if not bound or finish <= planned:
            return None
        if own / rate > planned:  # larger than the bound alone: waits at most the bound, ends by the timeout
            retry = max(ahead / rate - planned, finish - PLAN * self.timeout_s)
            if retry <= 0:
                return None
        else:
            retry = finish - planned
        return _busy(f"this request (about {own:,} tokens) would wait behind {ahead:,} tokens of work in flight, "
                     f"about {finish:,.1f} s to its end at {rate:,.0f} tokens/s, over the queue bound of "
                     f"{bound:g} s (--queue-bound-s, else the model's max_queue_seconds)", retry)

    def retry_after_s(self, model: ServedModel) -> float:
        """Seconds until this model's bulk work in flight drains to its queue bound (a refusal that
        came from Triton after admission: its Retry-After)."""
        load = self.load(model)
        rate = load.rate.tokens_per_s
        if rate is None:
            return 1.0
        return sum(load.lanes) / rate - PLAN * self.bound_s(model)


def _busy(message: str, retry_s: float) -> GatewayError:
    """429 with Retry-After: whole seconds, at least one (RFC 9110's delta-seconds)."""
    error = GatewayError(429, f"{message}: retry in {max(1, math.ceil(retry_s))} s")
    error.retry_after_s = max(1, math.ceil(retry_s))
    return error


def refused_later(error: GatewayError, admission: Admission, model: ServedModel) -> GatewayError:
    """A 429 that came from Triton for admitted work, with Retry-After from this model's backlog."""
    if error.status == 429:
        error.retry_after_s = max(1, math.ceil(admission.retry_after_s(model)))
    return error


class _Watch:
    """One request's client, watched for leaving once asked (watch_client) and its body is read."""

    def __init__(self, receive: Callable, send: Callable, handler: asyncio.Task) -> None:
        self.receive_next, self.send_next, self.handler = receive, send, handler
        self.task: asyncio.Task | None = None
        self.wanted = self.body_read = self.answered = self.gone = False

    def start(self) -> None:
        self.wanted = True
        if self.body_read and self.task is None and not self.answered:
            self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> dict[str, Any]:
        message = await self.receive_next()
        if message["type"] == "http.disconnect" and not self.answered:
            self.gone = True
            self.handler.cancel()
        return message

    async def receive(self) -> dict[str, Any]:
        if self.task is not None:  # (the watcher holds the next message)
            return await asyncio.shield(self.task)
        message = await self.receive_next()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_read = True
            if self.wanted:
                self.start()
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.answered = True
        await self.send_next(message)


_WATCH: ContextVar[_Watch | None] = ContextVar("pergola_gateway_watch", default=None)


def watch_client() -> None:
    """From now on, the request being answered is cancelled if its client leaves (CancelOnDisconnect).
    Asked by backend.py for work worth cancelling only: watching costs a task per request (~20 us
    of the gateway's CPU), more than a query's own admission."""
    watch = _WATCH.get()
    if watch is not None:
        watch.start()


class CancelOnDisconnect:
    """ASGI middleware: a POST whose client goes away while it is answered is cancelled, and with it
    the request's work (backend.py: chunks not yet sent are never sent; calls in flight over gRPC
    are cancelled in Triton, whose encoder drops them between steps).

    uvicorn does not cancel a handler when its client leaves: it only answers the next receive()
    with `http.disconnect`. So once the body has been read and the request asked for it
    (watch_client), a task waits on receive() for the request's lifetime and cancels the
    handler's task when the client is gone before the answer is complete; the answer is then
    counted as 499 (nginx's "client closed request")."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        watch = _Watch(receive, send, asyncio.current_task())  # type: ignore[arg-type]
        token = _WATCH.set(watch)
        try:
            await self.app(scope, watch.receive, watch.send)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            watch.handler.uncancel()
            # (uvicorn drops what is sent to a connection that is gone; the metrics see the status)
            await send({"type": "http.response.start", "status": 499, "headers": []})
        finally:
            _WATCH.reset(token)
            if watch.task is not None:
                watch.task.cancel()
