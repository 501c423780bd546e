"""OpenAI's Files and Batch APIs, as the openai SDK speaks them, for /v1/embeddings and /v1/rerank.

    POST   /v1/files                   multipart: file (JSONL of request lines), purpose=batch -> FileObject
    GET    /v1/files                   ?purpose, limit (<= 10,000), after, order=asc|desc
    GET    /v1/files/{id}              -> FileObject
    GET    /v1/files/{id}/content      the file as uploaded, or a job's output / error lines
    DELETE /v1/files/{id}              -> {"id", "object": "file", "deleted": true}
    POST   /v1/batches                 {"input_file_id", "endpoint", "completion_window": "24h", "metadata"} -> Batch
    GET    /v1/batches                 ?limit (<= 100), after: newest first
    GET    /v1/batches/{id}            -> Batch (status, request_counts, output_file_id, error_file_id, usage)
    POST   /v1/batches/{id}/cancel     -> Batch (cancelling, then cancelled)

Beside OpenAI: a batch's lines may name either endpoint (each runs at its own `url`), and a line
that is not a request goes to the error file instead of failing the batch. Keys are checked
as on every route. Limits: --batch-max-file-bytes, --batch-max-lines (413 naming them).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Route
from starlette.types import Message, Receive

from pergola.gateway.batch.lines import URLS
from pergola.gateway.batch.runner import Runner, window_seconds
from pergola.gateway.batch.store import ACTIVE, Store, new_id, now
from pergola.gateway.errors import GatewayError, bad_request
from pergola.gateway.options import GatewayOptions

FORM_SLACK = 64 << 10  # bytes of a multipart body besides the file (boundaries, part headers, purpose)
MAX_METADATA = (16, 64, 512)  # OpenAI's: pairs, characters of a key, of a value
COPY_BYTES = 1 << 20


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A files row as the SDK's FileObject."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """A batches row as the SDK's Batch."""
    times = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
             "expired_at", "cancelling_at", "cancelled_at")
    tokens = row["input_tokens"]
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": orjson.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{t: row[t] for t in times},
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]},
            "metadata": orjson.loads(row["metadata"]) if row["metadata"] else None, "model": None,
            "usage": {"input_tokens": tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": tokens}}


def page(rows: list[dict[str, Any]], limit: int, shape: Callable[[dict], dict]) -> dict[str, Any]:
    """A cursor page as the SDK reads it (`rows`: up to limit + 1, the extra one says there is more)."""
    data = [shape(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


def query_int(request: Request, name: str, default: int, most: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"`{name}` must be an integer from 1 to {most:,}, got {raw!r}", name)
    return int(raw)


def limited(receive: Receive, most: int, option: str) -> Receive:
    """`receive` that refuses a body over `most` bytes as it arrives (413 naming `option`)."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > most:
            raise GatewayError(413, f"the upload is over {most:,} bytes ({option}): split the file")
        return message

    return counted


def save(source: Any, path: Path, max_bytes: int, max_lines: int) -> int:
    """Copy an upload to `path` -> its bytes; 413 naming the option over a limit (nothing kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    size = count = 0
    last = b"\n"
    try:
        with open(path, "wb") as out:
            while chunk := source.read(COPY_BYTES):
                size += len(chunk)
                count += chunk.count(b"\n")
                if size > max_bytes:
                    raise GatewayError(413, f"the file is over {max_bytes:,} bytes (--batch-max-file-bytes): "
                                            "split it over several batches")
                if count > max_lines:
                    raise GatewayError(413, f"the file has over {max_lines:,} lines (--batch-max-lines): split it "
                                            "over several batches")
                out.write(chunk)
                last = chunk[-1:]
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if count + (last != b"\n") > max_lines:
        path.unlink()
        raise GatewayError(413, f"the file has over {max_lines:,} lines (--batch-max-lines): split it over "
                                "several batches")
    return size


def metadata_of(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    pairs, key_chars, value_chars = MAX_METADATA
    if not isinstance(value, dict) or len(value) > pairs or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= key_chars and len(v) <= value_chars
            for k, v in value.items()):
        raise bad_request(f"`metadata` takes at most {pairs} pairs of strings, keys of at most {key_chars} "
                          f"characters and values of at most {value_chars}", "metadata")
    return value


class BatchAPI:
    """The routes and the job runner of one gateway process. The store is opened when the API is
    first used, or at start when its database exists (jobs to resume); a gateway whose batch
    API is never used writes nothing."""

    def __init__(self, opts: GatewayOptions) -> None:
        for name in ("batch_max_file_bytes", "batch_max_lines", "batch_concurrency", "batch_call_chars"):
            if getattr(opts, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(opts, name)}")
        self.opts = opts
        self.data = Path(opts.batch_data).expanduser()
        self.database = Path(opts.batch_database).expanduser() if opts.batch_database else self.data / "batch.sqlite3"
        self.store = Store(self.data, self.database)
        self._runner: Runner | None = None
        self._task: asyncio.Task | None = None
        self._gateway: Any = None

    @contextlib.asynccontextmanager
    async def running(self, gateway: Any) -> AsyncIterator[None]:
        """Around the gateway's life: resume the jobs left in the database, stop them at the end
        (a job stopped mid-way resumes at the next start)."""
        self._gateway = gateway
        if self.database.exists():
            self.runner()
        try:
            yield
        finally:
            if self._task is not None:
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            await self.store.close()

    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = Runner(self.store, self._gateway, self.opts)
            # (a context of its own: started from a request, it would inherit that request's
            # client watch, admission.watch_client, and trace, gateway/tracing.py)
            self._task = asyncio.get_running_loop().create_task(self._runner.run(), context=contextvars.Context())
        return self._runner

    def routes(self, route: Callable[..., Route]) -> list[Route]:
        """The routes, made by the app's `route(path, family, handler, method)` (keys, envelopes)."""
        return [route("/v1/files", "openai", self.upload), route("/v1/files", "openai", self.list_files, "GET"),
                route("/v1/files/{file_id}", "openai", self.get_file, "GET"),
                route("/v1/files/{file_id}", "openai", self.delete_file, "DELETE"),
                route("/v1/files/{file_id}/content", "openai", self.content, "GET"),
                route("/v1/batches", "openai", self.create), route("/v1/batches", "openai", self.list_batches, "GET"),
                route("/v1/batches/{batch_id}", "openai", self.get_batch, "GET"),
                route("/v1/batches/{batch_id}/cancel", "openai", self.cancel)]

    async def _use(self, call: Awaitable[Any]) -> Any:
        """A store call, the runner started first; a store that cannot be opened is 503 naming the options."""
        self.runner()
        try:
            return await call
        except (sqlite3.Error, OSError) as e:
            raise GatewayError(503, f"the batch store ({self.database}) cannot be used: {e}; see --batch-data "
                                    "and --batch-database") from None

    # --- files -------------------------------------------------------------------------------

    async def upload(self, gw: Any, request: Request) -> dict[str, Any]:
        most = self.opts.batch_max_file_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > most + FORM_SLACK:
            raise GatewayError(413, f"the upload is {int(declared):,} bytes; the limit is {most:,} "
                                    "(--batch-max-file-bytes): split the file")
        counted = Request(request.scope, limited(request.receive, most + FORM_SLACK, "--batch-max-file-bytes"))
        try:
            form = await counted.form(max_files=1, max_fields=8)
        except (HTTPException, MultiPartException) as e:
            raise bad_request(f"POST /v1/files takes a multipart form (file, purpose): {getattr(e, 'detail', e)}")
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise bad_request(f"`purpose` must be batch (the only purpose served here), got {purpose!r}", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("`file` is required: the JSONL of request lines, as a file part", "file")
            file_id = new_id("file-")
            path = self.store.file_path(file_id)
            size = await self._use(asyncio.to_thread(save, upload.file, path, most, self.opts.batch_max_lines))
            row = {"id": file_id, "bytes": size, "created_at": now(), "filename": upload.filename or "upload.jsonl",
                   "purpose": "batch", "path": str(path)}
            await self._use(self.store.add_file(row))
            return file_object(row)
        finally:
            await form.close()

    async def _row(self, request: Request, kind: str) -> dict[str, Any]:
        """The file or batch the path names (404 naming it)."""
        key = f"{kind}_id"
        wanted = request.path_params[key]
        row = await self._use(self.store.file(wanted) if kind == "file" else self.store.batch(wanted))
        if row is None:
            raise GatewayError(404, f"no {kind} {wanted!r} here", key)
        return row

    async def get_file(self, gw: Any, request: Request) -> dict[str, Any]:
        return file_object(await self._row(request, "file"))

    async def list_files(self, gw: Any, request: Request) -> dict[str, Any]:
        limit = query_int(request, "limit", 10_000, 10_000)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"`order` must be asc or desc, got {order!r}", "order")
        rows = await self._use(self.store.files(request.query_params.get("purpose"),
                                                request.query_params.get("after"), limit + 1, order == "desc"))
        return page(rows, limit, file_object)

    async def content(self, gw: Any, request: Request) -> FileResponse:
        row = await self._row(request, "file")
        if not await asyncio.to_thread(Path(row["path"]).exists):
            raise GatewayError(404, f"the content of file {row['id']!r} is gone from the data folder", "file_id")
        return FileResponse(row["path"], media_type="application/octet-stream")

    async def delete_file(self, gw: Any, request: Request) -> dict[str, Any]:
        row = await self._row(request, "file")
        busy = await self._use(self.store.delete_file(row["id"]))
        if busy is not None:
            raise bad_request(f"file {row['id']!r} is the input of batch {busy}, which is not finished; cancel "
                              "the batch first", "file_id")
        await asyncio.to_thread(Path(row["path"]).unlink, missing_ok=True)
        return {"id": row["id"], "object": "file", "deleted": True}

    # --- batches -----------------------------------------------------------------------------

    async def create(self, gw: Any, request: Request) -> dict[str, Any]:
        body = await gw.body(request)
        input_file_id = body.get("input_file_id", str, required=True)
        endpoint = body.get("endpoint", str, required=True)
        if endpoint not in URLS:
            raise bad_request(f"`endpoint` must be one of {', '.join(URLS)}, got {endpoint!r}", "endpoint")
        window = body.get("completion_window", str, required=True)
        seconds = window_seconds(window)
        if seconds is None:
            raise bad_request(f"`completion_window` must be hours, such as 24h; got {window!r}", "completion_window")
        metadata = metadata_of(body.get("metadata", dict))
        source = await self._use(self.store.file(input_file_id))
        if source is None:
            raise GatewayError(404, f"no file {input_file_id!r} here: upload it first (POST /v1/files)",
                               "input_file_id")
        if source["purpose"] != "batch":
            raise bad_request(f"file {input_file_id!r} is a {source['purpose']} file, not an input of purpose batch",
                              "input_file_id")
        created = now()
        row = {"id": new_id("batch_"), "created_at": created, "input_file_id": input_file_id, "endpoint": endpoint,
               "completion_window": window, "metadata": orjson.dumps(metadata).decode() if metadata else None,
               "status": "validating", "expires_at": created + seconds}
        await self._use(self.store.add_batch(row))
        self.runner().wake()
        return batch_object(await self._use(self.store.batch(row["id"])))

    async def get_batch(self, gw: Any, request: Request) -> dict[str, Any]:
        return batch_object(await self._row(request, "batch"))

    async def list_batches(self, gw: Any, request: Request) -> dict[str, Any]:
        limit = query_int(request, "limit", 20, 100)
        rows = await self._use(self.store.batches(request.query_params.get("after"), limit + 1))
        return page(rows, limit, batch_object)

    async def cancel(self, gw: Any, request: Request) -> dict[str, Any]:
        row = await self._row(request, "batch")
        if row["status"] not in ("cancelling", "cancelled"):
            moved = await self._use(self.store.move(row["id"], tuple(s for s in ACTIVE if s != "cancelling"),
                                                    status="cancelling", cancelling_at=now()))
            if not moved:
                raise bad_request(f"batch {row['id']} is {row['status']}: only a validating or in_progress batch "
                                  "can be cancelled", "batch_id")
            runner = self.runner()
            runner.cancel(row["id"])
            runner.wake()
        return batch_object(await self._row(request, "batch"))
