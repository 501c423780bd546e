"""Running batch jobs: each gateway process drives the jobs it can lock, one at a time, oldest first.

A job goes validating -> in_progress -> completed (or failed: no line is a request; cancelling ->
cancelled; expired past its completion window). Validation reads the whole input file first:
lines that are not requests go to the error file at once, and the rest run. They run in waves
of about `batch_call_chars` characters, `batch_concurrency` waves in flight
(gateway/batch/coalesce.py: each wave's lines share a few large calls on the bulk lane).

Durability: a wave's records are appended to the output and error files and fsync'ed before the
job's counts move; the files are the record of what is done (each record's id names its input
line), so a gateway killed mid-job, restarted on the same data folder, reads them and runs only
the lines without a record: none twice, none lost. One process drives a job at a time: it holds
the job folder's `lock` (flock, let go by the kernel when the process dies), so the worker
processes of one gateway share the jobs without running one twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import fcntl
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pergola.gateway import openai_api, rerank_api
from pergola.gateway.backend import Backend
from pergola.gateway.batch import lines
from pergola.gateway.batch.coalesce import LineBackend, LineGateway, WaitingOffload, Wave, job_admission, retrying
from pergola.gateway.batch.store import Store, new_id, now
from pergola.gateway.errors import GatewayError
from pergola.gateway.http import JSONResponse, error_response
from pergola.gateway.options import GatewayOptions
from pergola.text.errors import RequestError

log = logging.getLogger("pergola.gateway")
HANDLERS = {"/v1/embeddings": openai_api.embeddings, "/v1/rerank": rerank_api.rerank_route}  # lines.URLS' routes
WAVE_LINES = 1024  # most lines in one wave (a wave of tiny lines is bounded by count, not characters)
POLL_S = 1.0  # how often an idle runner looks for jobs, and a running job for a cancel from another worker
JOB_TIMEOUTS = 10  # a job's call may take this many --request-timeout-s
WINDOW = re.compile(r"^([1-9][0-9]*)h$")


def window_seconds(window: str) -> int | None:
    """A completion_window ("24h") in seconds; None if it is not one."""
    found = WINDOW.match(window)
    return int(found[1]) * 3600 if found else None


def line_request(line: lines.Line) -> Request:
    """A line as the HTTP request its route reads (the body, its length; no key: the job was
    created with one)."""
    scope = {"type": "http", "method": "POST", "path": line.url, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(line.body)).encode())]}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": line.body, "more_body": False}

    return Request(scope, receive)


class Pending:
    """The input lines still to run, read in waves (on a thread: the file may be large)."""

    def __init__(self, path: Path, done: set[int]) -> None:
        self._lines = lines.raw_lines(path)
        self.done = done

    def wave(self, max_chars: int) -> list[lines.Line]:
        out, chars = [], 0
        for number, raw in self._lines:
            if number in self.done:
                continue
            line = lines.parse(number, raw)
            if isinstance(line, lines.BadLine):  # (validation wrote it already: its record is in `done`)
                continue
            out.append(line)
            chars += len(raw)
            if chars >= max_chars or len(out) >= WAVE_LINES:
                break
        return out


def unanswered(path: Path, files: list[Path]) -> list[int]:
    """The request lines of `path` that none of `files` holds a record of."""
    done = set().union(*(lines.answered(f)[0] for f in files))
    return [n for n, raw in lines.raw_lines(path) if n not in done and isinstance(lines.parse(n, raw), lines.Line)]


def validate(path: Path, errors: Path, batch_id: str) -> tuple[int, list[lines.BadLine]]:
    """Check every line of `path` -> (lines, the bad ones), whose records start the error file."""
    seen: set[str] = set()
    bad, total = [], 0
    for number, raw in lines.raw_lines(path):
        total += 1
        line = lines.parse(number, raw, seen)
        if isinstance(line, lines.BadLine):
            bad.append(line)
    errors.parent.mkdir(parents=True, exist_ok=True)
    errors.write_bytes(b"")  # (a validation cut short by a crash starts over)
    lines.append(errors, [lines.refusal(batch_id, b) for b in bad])
    return total, bad


@contextlib.contextmanager
def job_lock(folder: Path) -> Iterator[bool]:
    """Whether this process holds the job's lock (non-blocking: another process may be driving it)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # (closing lets the lock go)


class Job:
    """One batch job driven by this process."""

    def __init__(self, runner: Runner, batch_id: str) -> None:
        self.runner, self.store, self.id = runner, runner.store, batch_id
        folder = self.store.job_folder(batch_id)
        self.output, self.errors = folder / "output.jsonl", folder / "errors.jsonl"
        self.cancelled = asyncio.Event()
        self._write = asyncio.Lock()  # one append (and count) at a time
        self._records: set[asyncio.Task] = set()  # appends under way (the job's end waits for them)
        self.completed = self.failed = self.tokens = 0
        self.expires_at: int | None = None

    async def run(self) -> None:
        row = await self.store.batch(self.id)
        if row is not None and row["status"] == "validating":
            if await self.validate(row) == "failed":
                return
            row = await self.store.batch(self.id)
        if row is None:
            return
        self.expires_at = row["expires_at"]
        path = self.store.file_path(row["input_file_id"])
        await self.finish("cancelled" if row["status"] == "cancelling" else await self.process(path))

    async def validate(self, row: dict[str, Any]) -> str:
        """Check the lines -> "failed" when none is a request, else "in_progress"."""
        path = self.store.file_path(row["input_file_id"])
        total, bad = await asyncio.to_thread(validate, path, self.errors, self.id)
        listed = {"object": "list", "data": [lines.listed(b) for b in bad[:lines.MAX_LISTED_ERRORS]]}
        if total == len(bad):
            message = "no line of the input file is a request" if total else "the input file holds no request line"
            listed["data"].insert(0, {"code": "invalid_file", "line": None, "message": message, "param": None})
            await self.store.update(self.id, status="failed", failed_at=now(), total=total, failed=len(bad),
                                    errors=orjson.dumps(listed).decode())
            return "failed"
        await self.store.move(self.id, ("validating",), status="in_progress", in_progress_at=now(), total=total,
                              failed=len(bad), errors=orjson.dumps(listed).decode() if bad else None)
        return "in_progress"

    async def process(self, path: Path) -> str:
        """Run the lines without a record -> how the job ended: completed, cancelled or expired."""
        done_ok, tokens = await asyncio.to_thread(lines.answered, self.output)
        done_bad, _ = await asyncio.to_thread(lines.answered, self.errors)
        self.completed, self.failed, self.tokens = len(done_ok), len(done_bad), tokens
        await self.store.update(self.id, completed=self.completed, failed=self.failed, input_tokens=tokens)
        pending = Pending(path, done_ok | done_bad)
        work = asyncio.create_task(self._waves(pending))
        stop = asyncio.create_task(self._stopped())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, stop):
                task.cancel()
            outcome = await asyncio.gather(work, stop, return_exceptions=True)
        if work.done() and not work.cancelled() and work.exception() is None:
            return "completed"
        if isinstance(outcome[1], str):
            if outcome[1] == "expired":
                await self._expire(path)
            return outcome[1]
        raise outcome[0] if isinstance(outcome[0], BaseException) else RuntimeError("batch job stopped")

    async def _stopped(self) -> str:
        """Returns when the job is cancelled (here or through another worker) or expires."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.cancelled.wait(), POLL_S)
                return "cancelled"
            if self.expires_at is not None and time.time() >= self.expires_at:
                return "expired"
            row = await self.store.batch(self.id)
            if row is None or row["status"] == "cancelling":
                return "cancelled"

    async def _waves(self, pending: Pending) -> None:
        slots = asyncio.Semaphore(self.runner.opts.batch_concurrency)
        running: set[asyncio.Task] = set()
        try:
            while True:
                await slots.acquire()
                while len(running) >= 2 * self.runner.opts.batch_concurrency:  # (answers waiting for the disk)
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                wave = await asyncio.to_thread(pending.wave, self.runner.opts.batch_call_chars)
                if not wave:
                    break
                task = asyncio.create_task(self._wave(wave, slots))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _wave(self, batch: list[lines.Line], slots: asyncio.Semaphore) -> None:
        """Answer a wave's lines, free its slot (the next wave's calls start while this one is
        written), then record the answers."""
        wave = Wave(self.runner.backend, len(batch), self.runner.opts.batch_call_chars)
        try:
            answers = await asyncio.gather(*(self._line(wave, line) for line in batch))
        finally:
            wave.cancel()
            slots.release()
        # (shielded: once computed, a wave's answers are written even if the job is cancelled meanwhile)
        task = asyncio.create_task(self._record(answers))
        self._records.add(task)
        task.add_done_callback(self._records.discard)
        await asyncio.shield(task)

    async def _line(self, wave: Wave, line: lines.Line) -> tuple[lines.Line, int, bytes, int]:
        """(line, HTTP status, the route's JSON answer, tokens used) for one line."""
        backend = LineBackend(wave)
        try:
            gateway = LineGateway(self.runner.gateway, backend, self.runner.offload)
            result = await retrying(lambda: HANDLERS[line.url](gateway, line_request(line)))
            # (as gateway/http.py's endpoint answers: a route's Response, or its content as JSON)
            response = result if isinstance(result, Response) else JSONResponse(result)
            status, body, tokens = response.status_code, bytes(response.body), backend.tokens
        except (GatewayError, RequestError) as e:
            response = error_response(e, lines.URLS[line.url])
            status, body, tokens = response.status_code, bytes(response.body), 0
        except Exception as e:  # noqa: BLE001 - a bug: this line says so, the job goes on
            log.exception("batch %s line %d failed", self.id, line.number)
            response = error_response(GatewayError(500, f"internal error in the gateway: {type(e).__name__}: {e}"),
                                      lines.URLS[line.url])
            status, body, tokens = response.status_code, bytes(response.body), 0
        finally:
            backend.arrive()  # (a line refused before it reached the backend no longer holds its wave back)
        return line, status, body, tokens

    async def _record(self, answers: list[tuple[lines.Line, int, bytes, int]]) -> None:
        ok = [lines.answer(self.id, line, status, body) for line, status, body, _ in answers if status < 300]
        bad = [lines.answer(self.id, line, status, body) for line, status, body, _ in answers if status >= 300]
        async with self._write:
            await asyncio.to_thread(lines.append, self.output, ok)
            await asyncio.to_thread(lines.append, self.errors, bad)
            self.completed += len(ok)
            self.failed += len(bad)
            self.tokens += sum(t for *_, t in answers)
            await self.store.update(self.id, completed=self.completed, failed=self.failed, input_tokens=self.tokens)

    async def _expire(self, path: Path) -> None:
        """The lines not run before the completion window closed, answered as OpenAI does."""
        async with self._write:
            rest = await asyncio.to_thread(unanswered, path, [self.output, self.errors])
            message = "This request could not be executed before the completion window expired."
            records = [lines.refusal(self.id, lines.BadLine(n, None, message, code="batch_expired")) for n in rest]
            await asyncio.to_thread(lines.append, self.errors, records)

    async def finish(self, status: str) -> None:
        """The job's end: its files join the API's files and the row says how it ended, together."""
        await asyncio.gather(*self._records, return_exceptions=True)  # (any wave still writing)
        async with self._write:
            self.completed = await asyncio.to_thread(lines.count_lines, self.output)
            self.failed = await asyncio.to_thread(lines.count_lines, self.errors)
            files, ids = [], {}
            for key, path, count in (("output_file_id", self.output, self.completed),
                                     ("error_file_id", self.errors, self.failed)):
                if count:
                    ids[key] = new_id("file-")
                    files.append({"id": ids[key], "bytes": path.stat().st_size, "created_at": now(),
                                  "filename": f"{self.id}_{path.stem}.jsonl", "purpose": "batch_output",
                                  "path": str(path)})
            stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[status]
            await self.store.finish(self.id, files, status=status, finalizing_at=now(), **{stamp: now()}, **ids,
                                    completed=self.completed, failed=self.failed)
        log.info("batch %s %s: %d answered, %d failed", self.id, status, self.completed, self.failed)


class Runner:
    """This process's driver of batch jobs (one at a time); `wake()` when a job is created."""

    def __init__(self, store: Store, gateway: Any, opts: GatewayOptions) -> None:
        self.store, self.gateway, self.opts = store, gateway, opts
        # The gateway's backend (a copy: the same replicas, tokenizers and keys) with calls cut
        # only at call_chars (a wave's calls are already within the model's limits: large calls,
        # the bulk lane, gateway/batch/coalesce.py), and a deadline of JOB_TIMEOUTS times the
        # requests' (nobody waits on a job's call; one dropped at its deadline would be redone),
        # admitted against the same work in flight as every request (coalesce.job_admission).
        self.backend: Backend = copy.copy(gateway.backend)
        self.backend.chunk_texts, self.backend.chunk_chars = 1 << 30, opts.batch_call_chars
        self.backend.timeout_s = JOB_TIMEOUTS * opts.request_timeout_s
        self.backend.admission = job_admission(gateway.backend.admission, self.backend.timeout_s)
        self.offload = WaitingOffload(gateway.offload)
        self.jobs: dict[str, Job] = {}  # batch id -> the job this process drives
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop the job now if this process drives it (another process sees its row within POLL_S)."""
        job = self.jobs.get(batch_id)
        if job is not None:
            job.cancelled.set()

    async def run(self) -> None:
        while True:
            self._wake.clear()
            ran = False
            try:
                for batch_id in await self.store.active():
                    ran = await self.drive(batch_id)
                    if ran:
                        break
            except (OSError, sqlite3.Error) as e:  # the store is away (a full or gone disk): retry later
                log.error("batch jobs: cannot read the store: %s", e)
            if not ran:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_S)

    async def drive(self, batch_id: str) -> bool:
        """Run the job if no other process does -> whether this one did."""
        with job_lock(self.store.job_folder(batch_id)) as mine:
            if not mine:
                return False
            job = self.jobs[batch_id] = Job(self, batch_id)
            try:
                await job.run()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the job fails, saying why; the gateway goes on
                log.exception("batch %s failed", batch_id)
                errors = {"object": "list", "data": [{"code": "server_error", "line": None, "param": None,
                                                      "message": f"the job stopped: {type(e).__name__}: {e}"}]}
                await self.store.update(batch_id, status="failed", failed_at=now(), errors=orjson.dumps(errors).decode())
            finally:
                del self.jobs[batch_id]
            return True
