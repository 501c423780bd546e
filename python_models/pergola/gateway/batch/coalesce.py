"""How a batch job's lines reach the replicas: each line runs through its route's own handler
(so its body is read and checked exactly as the route would), and the handler's calls to the
backend are packed, per wave of lines, into few large calls.

Why pack: a line is often one short text. Sent alone, each would be a query-sized request that
takes the encoders' query lane (engine/scheduler.py's LaneQueue: requests of at most
`query_tokens` tokens), competing with the online queries the lane is there for, and paying
a round trip per text. Packed into calls of about `batch_call_chars` characters (~16k tokens of
English by default), a job's work rides the bulk lane: every query's step runs before it, or
between its layers (engine/loop.py). Only lines of one model and one set of options share a call
(EmbedRequest is its key); a call holds at most the model's max_texts texts and
max_request_chars characters, which its tokenizer enforces again. A reranking line keeps its own
call (one query per call), retried the same way.

A call refused for load (429, 503) or past its deadline (504) is retried with backoff, never
failed: the load passes, the job waits. A call refused for its input (400, 413) is run again
line by line, so that only the line at fault gets the error, worded by its route.

Admission (gateway/admission.py): a job's calls are weighed as any request's, against the same
work in flight and measured throughput per model, so that online requests see a job's calls
ahead of them and a job's calls see theirs; only the deadline is a job call's (job_admission).
Its 429s are load that passes: retried as above. A call with nothing ahead of it is always
admitted, so the job's own calls finishing is enough for the next to go.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pergola.gateway.admission import Admission
from pergola.gateway.backend import Backend, Embedded, EmbedRequest, RerankRequest
from pergola.gateway.catalog import ServedModel
from pergola.gateway.errors import GatewayError
from pergola.gateway.offload import Offload, TokenIds
from pergola.text.errors import RequestError

log = logging.getLogger("pergola.gateway")
T = TypeVar("T")
RETRIED = (429, 503, 504)  # load that passes, a replica away, a deadline under load: wait and try again
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.25, 10.0


async def retrying(call: Callable[[], Awaitable[T]]) -> T:
    """call() until it is not refused for load; the waits double up to MAX_BACKOFF_S (jittered,
    so that waves refused together do not come back together)."""
    delay = FIRST_BACKOFF_S
    while True:
        try:
            return await call()
        except GatewayError as e:
            if e.status not in RETRIED:
                raise
            log.info("batch job: a call was refused (%d: %s); retrying in %.2f s", e.status, e.message, delay)
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(2 * delay, MAX_BACKOFF_S)


def job_admission(admission: Admission, timeout_s: float) -> Admission:
    """The gateway's admission as a job's calls pass it: the same loads (work in flight, measured
    throughput, characters per token) per model, judged against a job call's deadline `timeout_s`
    (its 413, and the time Triton is told) instead of a request's: nobody waits on a job's call,
    and one dropped at its deadline would be computed again."""
    shared = Admission(timeout_s, admission.queue_bound_s)
    shared.loads = admission.loads
    return shared


@dataclass
class _Member:
    start: int  # its items' [start, end) in the group's
    end: int
    answer: asyncio.Future


@dataclass
class _Group:
    """Lines' items bound for one backend call: call(model, items) -> result; split(result, a, b)."""

    model: ServedModel
    call: Callable[[ServedModel, list], Awaitable[Any]]
    split: Callable[[Any, int, int], Any]
    items: list = field(default_factory=list)
    chars: int = 0
    members: list[_Member] = field(default_factory=list)


def _sliced(out: Embedded, start: int, end: int) -> Embedded:
    return Embedded(out.vectors[start:end], out.tokens[start:end])


def _rows(ids: TokenIds) -> list[np.ndarray]:
    """Token ids as one [tokens] int64 array per input (views of ids.flat)."""
    return [ids.flat[a:b] for a, b in itertools.pairwise(ids.offsets().tolist())]


def _flat(rows: list[np.ndarray]) -> TokenIds:
    """Inputs' token ids (of several lines) as one call's TokenIds."""
    return TokenIds(np.concatenate(rows), np.fromiter(map(len, rows), dtype=np.int32, count=len(rows)))


class Wave:
    """The backend calls of a wave of lines: groups fill while the wave's lines are being read by
    their handlers, and each is sent once no line of the wave can still join it (`waiting`: the
    lines that have neither reached the backend nor finished)."""

    def __init__(self, backend: Backend, lines: int, call_chars: int) -> None:
        self.backend, self.waiting, self.call_chars = backend, lines, call_chars
        self._groups: dict[Hashable, _Group] = {}
        self._calls: set[asyncio.Task] = set()

    def arrived(self) -> None:
        """One line reached the backend, or finished without: send every group once none is left."""
        self.waiting -= 1
        if self.waiting <= 0:
            for key in list(self._groups):
                self._send(self._groups.pop(key))

    async def join(self, line: LineBackend, key: Hashable, model: ServedModel, items: list, chars: int,
                   call: Callable[[ServedModel, list], Awaitable[Any]], split: Callable[[Any, int, int], Any]) -> Any:
        """The result for `items` (`line`'s), from a call shared with the wave's other lines of `key`."""
        group = self._groups.get(key)
        if group is not None and (len(group.items) + len(items) > model.limit("max_texts")
                                  or group.chars + chars > min(self.call_chars, model.limit("max_request_chars"))):
            self._send(self._groups.pop(key))  # full: it goes, this line starts the next one
            group = None
        if group is None:
            group = self._groups[key] = _Group(model, call, split)
        member = _Member(len(group.items), len(group.items) + len(items), asyncio.get_running_loop().create_future())
        group.items += items
        group.chars += chars
        group.members.append(member)
        line.arrive()  # (after joining: the last line to arrive sends the groups, its own included)
        if self.waiting <= 0 and key in self._groups:  # (a line calling the backend again, after that)
            self._send(self._groups.pop(key))
        return await member.answer

    def _send(self, group: _Group) -> None:
        task = asyncio.get_running_loop().create_task(self._run(group))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self, group: _Group) -> None:
        members = group.members
        try:
            out = await retrying(lambda: group.call(group.model, group.items))
        except (GatewayError, RequestError) as e:
            if len(members) == 1:
                _settle(members[0].answer, error=e)
                return
            # one line's input is refused (too long, ...): each line alone, so the error is its own
            await asyncio.gather(*(self._alone(group, m) for m in members))
            return
        except Exception as e:  # noqa: BLE001 - a bug: every line of the call says so
            for m in members:
                _settle(m.answer, error=e)
            return
        for m in members:
            _settle(m.answer, group.split(out, m.start, m.end))

    async def _alone(self, group: _Group, member: _Member) -> None:
        try:
            out = await retrying(lambda: group.call(group.model, group.items[member.start:member.end]))
        except Exception as e:  # noqa: BLE001 - the line's own error, worded by its route
            _settle(member.answer, error=e)
            return
        _settle(member.answer, group.split(out, 0, member.end - member.start))

    def cancel(self) -> None:
        """Drop the wave's calls in flight (the job was cancelled, or the gateway is stopping)."""
        for task in list(self._calls):
            task.cancel()


def _settle(future: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class LineBackend:
    """gw.backend as one line's handler sees it: embeddings through the wave's shared calls,
    reranking on its own, both retried under load."""

    def __init__(self, wave: Wave) -> None:
        self.wave = wave
        self.reached = False
        self.tokens = 0  # what the line's last answer used (its route's `usage`: the job's input_tokens)

    def arrive(self) -> None:
        if not self.reached:
            self.reached = True
            self.wave.arrived()

    def _used(self, out: T) -> T:
        self.tokens = int(out.tokens.sum())  # type: ignore[attr-defined]
        return out

    async def embed(self, model: ServedModel, texts: list[str], opts: EmbedRequest) -> Embedded:
        return self._used(await self.wave.join(
            self, ("texts", model.name, model.version, opts), model, texts, sum(map(len, texts)),
            lambda m, items: self.wave.backend.embed(m, items, opts), _sliced))

    async def embed_tokens(self, model: ServedModel, ids: TokenIds, opts: EmbedRequest) -> Embedded:
        # (an input's ids are one item; a token id weighs as ~4 characters: what call_chars means for texts)
        return self._used(await self.wave.join(
            self, ("ids", model.name, model.version, opts), model, _rows(ids), 4 * int(ids.flat.size),
            lambda m, items: self.wave.backend.embed_tokens(m, _flat(items), opts), _sliced))

    async def rerank(self, model: ServedModel, query: str, documents: list[str],
                     opts: RerankRequest = RerankRequest()) -> Any:
        self.arrive()
        return self._used(await retrying(lambda: self.wave.backend.rerank(model, query, documents, opts)))

    def __getattr__(self, name: str) -> Any:
        """Any other backend call (a route added to lines.URLS later), as it is."""
        self.arrive()
        return getattr(self.wave.backend, name)


class WaitingOffload:
    """gw.offload as a line's route sees it: a line's bulk CPU work (a large answer rendered) waits
    for a CPU worker rather than being refused with 429, which would make the job run the whole
    line, its backend call included, again. The job's concurrency bounds how many wait."""

    def __init__(self, offload: Offload) -> None:
        self._offload = offload

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await retrying(lambda: self._offload.run(fn, *args))


class LineGateway:
    """The Gateway as one line's route handler sees it: the same models, options, catalog and body
    reading (gw.body: the route's checks, a large body parsed in a CPU worker); its backend the
    line's, its CPU workers waited for (WaitingOffload)."""

    def __init__(self, gateway: Any, backend: LineBackend, offload: WaitingOffload) -> None:
        self._gateway, self.backend, self.offload = gateway, backend, offload

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gateway, name)
