"""The gateway's bulk CPU work in worker processes, so that no request holds the event loop.

One event loop serves every request of a gateway process: while it parses a 100 x 512 token-id
body or renders a 100 x 1,024-float answer, every other request waits, queries included. What
runs in a worker instead: parsing a body of at least PARSE_BYTES (token ids come back as one
int64 array, not 51,200 Python ints to convert again), rendering an answer of at least
RENDER_VALUES numbers, and /tokenize (tokenizing and rendering). Queries stay on the loop: below
those sizes a hand-off to a worker costs more than the work it moves.

Why processes, not threads: orjson holds the GIL for a whole call, and so does the Python that
builds an answer, so a thread frees the loop only between bytecodes: a request arriving beside
bulk parsing or rendering waits far less for the loop when that work runs in a process than on a
thread or on the loop itself (perf/results/2026-12-06-3bdfdf4-cpu/NOTES.md).

Bounded: `workers` processes, niced (bulk work yields the CPU to the loop and to Triton), and at
most `queue` jobs waiting for them; a request past that gets 429 with Retry-After (load that
passes). A worker that dies takes its pool's jobs with it: the pool is replaced and those
requests answered 503. After a job that took or made 8 MB a worker gives its freed heap back to
the system (pergola/memory.py), and the gateway does every 64 MB, so neither ratchets.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import numpy as np
import orjson

from pergola.gateway.errors import GatewayError, bad_request
from pergola.memory import trim

log = logging.getLogger("pergola.gateway")
T = TypeVar("T")
PARSE_BYTES = 64 << 10  # a request body of at least this many bytes is parsed in a worker (module docstring)
RENDER_VALUES = 16_384  # an answer of at least this many numbers (or tokens) is rendered in a worker
TRIM_BYTES = 8 << 20  # a worker trims its heap after a job that took or made this many bytes
MAIN_TRIM_BYTES = 64 << 20  # the gateway trims its own after this many bytes of jobs' bodies and answers
NICE = 5  # workers' priority below the event loop's and Triton's
INT32_MAX = 2**31 - 1  # the largest value of an INT32 tensor, and above every vocabulary's ids
_NUMBERS = {int, float, bool}  # what orjson makes of JSON numbers and booleans


@dataclass(frozen=True)
class TokenIds:
    """Token-id lists, flat: what NAME_encoder is sent (INPUT_IDS [1, T], LENGTHS [1, n])."""

    flat: np.ndarray  # [num_tokens] int64, every list's ids in order
    lengths: np.ndarray  # [n] int32: ids per list

    def offsets(self) -> np.ndarray:
        """[n + 1] int64: list i is flat[offsets[i]:offsets[i + 1]]."""
        return np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])


def token_ids(value: Any, field: str) -> TokenIds | None:
    """`value` as token ids when it is a list of integers or a list of such lists; None when it
    holds no integers (strings). Integers out of [0, 2^31), booleans and floats among them: 400
    naming `field`."""
    if not isinstance(value, list) or not value:
        return None
    kinds = set(map(type, value))  # (type(), not isinstance: True is not a token id)
    if kinds == {list}:
        rows = value
        kinds = set(map(type, chain.from_iterable(rows)))
    elif kinds & _NUMBERS:
        rows = [value]
    else:
        return None
    if kinds and not kinds & _NUMBERS:
        return None  # lists of strings (TEI's /predict pairs)
    if kinds != {int} or not all(rows):
        raise bad_request(f"`{field}` as token ids must be non-empty lists of integers (no booleans, no "
                          "decimals)", field)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    try:
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    except OverflowError:  # (orjson reads integers up to 2^64 - 1)
        flat = None
    if flat is None or int(flat.min()) < 0 or int(flat.max()) > INT32_MAX:
        raise bad_request(f"`{field}` as token ids must lie in [0, 2^31); this model's vocabulary is smaller still",
                          field)
    return TokenIds(flat, lengths.astype(np.int32))


def parse_body(raw: bytes, ids_field: str | None = None) -> Any:
    """A JSON body; its `ids_field`, when it holds token ids, as TokenIds (checked)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if ids_field and isinstance(data, dict):
        ids = token_ids(data.get(ids_field), ids_field)
        if ids is not None:
            data[ids_field] = ids
    return data


def render(build: Callable[..., Any], *args: Any) -> bytes:
    """build(*args) as JSON (numpy arrays written directly; a builder may render it itself)."""
    content = build(*args)
    return content if isinstance(content, bytes) else orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def as_is(content: Any) -> Any:
    """The builder of an answer that is its content already (an array, a list of arrays)."""
    return content


class Refused(Exception):
    """A GatewayError raised in a worker, as it crosses back (GatewayError's own arguments do not
    survive pickling)."""

    def __init__(self, status: int, message: str, param: str | None) -> None:
        super().__init__(status, message, param)


def _size(values: tuple) -> int:
    """Bytes of the raw bodies and rendered answers among `values` (what a job takes or makes)."""
    return sum(len(v) for v in values if isinstance(v, (bytes, bytearray)))


def _job(fn: Callable[..., T], args: tuple) -> T:
    """fn(*args) in a worker; after a large one the freed heap goes back to the system
    (pergola/memory.py: glibc keeps it otherwise, and each worker would ratchet to its largest job)."""
    try:
        out = fn(*args)
    except GatewayError as e:
        raise Refused(e.status, e.message, e.param) from None
    if _size((*args, out)) >= TRIM_BYTES:
        trim()
    return out


def _start_worker() -> None:
    """Each worker: lower priority, no Ctrl-C of its own (the gateway stops it), and SIGTERM when
    the gateway dies (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.nice(NICE)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _ready() -> int:
    return os.getpid()


class Offload:
    """`workers` processes for bulk CPU work (0: everything on the event loop) and a bound of
    `queue` jobs waiting for them."""

    def __init__(self, workers: int, queue: int) -> None:
        self.workers, self.queue = workers, queue
        self._jobs = 0  # submitted, not finished
        self._since_trim = 0  # bytes of bodies and answers handed over since the gateway last trimmed its heap
        self._pool: ProcessPoolExecutor | None = self._new_pool() if workers > 0 else None

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: a fresh interpreter (vfork + exec, so gRPC's fork handlers never run)
        return ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_start_worker)

    def warm(self) -> None:
        """Start the workers now (a spawned interpreter takes ~0.5 s), not on the first bulk request."""
        if self._pool is not None:
            for _ in range(self.workers):
                self._pool.submit(_ready)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker (on the loop when there are none); 429 when `queue` jobs wait."""
        if self._pool is None:
            return fn(*args)
        if self._jobs >= self.workers + self.queue:
            raise GatewayError(429, f"the gateway's {self.workers} CPU workers have {self.queue} bulk requests "
                                    "waiting (--gateway-cpu-queue); retry shortly")
        pool = self._pool
        self._jobs += 1
        try:
            out = await asyncio.wrap_future(pool.submit(_job, fn, args))
            self._after(_size((*args, out)))
            return out
        except Refused as e:
            raise GatewayError(*e.args) from None
        except BrokenProcessPool:
            self._replace(pool)
            raise GatewayError(503, "a gateway CPU worker stopped while working on this request; retry") from None
        finally:
            self._jobs -= 1

    def _after(self, size: int) -> None:
        """Count a job's bytes; past MAIN_TRIM_BYTES trim the gateway's heap on a thread (malloc_trim
        releases the GIL: the loop goes on meanwhile)."""
        self._since_trim += size
        if self._since_trim >= MAIN_TRIM_BYTES:
            self._since_trim = 0
            asyncio.get_running_loop().run_in_executor(None, trim)

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is broken:  # (once for every job it took down)
            log.warning("a gateway CPU worker died; starting new ones")
            broken.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
