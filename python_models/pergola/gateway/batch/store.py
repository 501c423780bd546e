"""The Batch API's durable state: files and jobs in SQLite, file contents under the data folder.

    DATA/batch.sqlite3            files and batches (one row each; WAL, so worker processes share it)
    DATA/files/FILE_ID            an uploaded input file, as sent
    DATA/batches/BATCH_ID/        output.jsonl, errors.jsonl (appended as lines finish), lock

Every call runs on one thread of its own (sqlite3 blocks; the connection belongs to that
thread), so the event loop never waits on the disk. A row's columns are the API object's fields
(gateway/batch/api.py turns rows into the openai SDK's `FileObject` and `Batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, path TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, input_file_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL,
    in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    cancelling_at INTEGER, cancelled_at INTEGER, expires_at INTEGER, expired_at INTEGER,
    output_file_id TEXT, error_file_id TEXT, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0);
"""
# A job some process still has to drive: validate, run, or wind down.
ACTIVE = ("validating", "in_progress", "cancelling")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


class Store:
    """Rows of `files` and `batches` as dicts; each method runs on the store's own thread."""

    def __init__(self, data: Path, database: Path) -> None:
        self.data, self.database = data, database
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pergola-batch-db")
        self._db: sqlite3.Connection | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(connection, *args) on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        if self._db is None:
            self.database.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.database, timeout=30, isolation_level=None)  # autocommit; see _transaction
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")  # a job's state survives power loss, not only a crash
            db.executescript(SCHEMA)
            self._db = db
        return fn(self._db, *args)

    async def close(self) -> None:
        def shut(db: sqlite3.Connection) -> None:
            db.close()
            self._db = None
        if self._db is not None:
            await self.run(shut)
        self._pool.shutdown(wait=False)

    # --- paths -------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.data / "files" / file_id

    def job_folder(self, batch_id: str) -> Path:
        return self.data / "batches" / batch_id

    # --- files -------------------------------------------------------------------------------

    async def add_file(self, row: dict[str, Any]) -> None:
        await self.run(_insert, "files", row)

    async def file(self, file_id: str) -> dict[str, Any] | None:
        return await self.run(_one, "SELECT * FROM files WHERE id = ?", (file_id,))

    async def files(self, purpose: str | None, after: str | None, limit: int, newest_first: bool) -> list[dict]:
        """Up to `limit` files after the one named `after`, in upload order or its reverse."""
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"rowid {'<' if newest_first else '>'} (SELECT rowid FROM files WHERE id = ?)")
            args.append(after)
        sql = (f"SELECT * FROM files {'WHERE ' + ' AND '.join(where) if where else ''} "
               f"ORDER BY rowid {'DESC' if newest_first else 'ASC'} LIMIT ?")
        return await self.run(_all, sql, (*args, limit))

    async def delete_file(self, file_id: str) -> str | None:
        """Remove a file's row -> the batch that still reads it (nothing removed), else None."""
        def delete(db: sqlite3.Connection) -> str | None:
            with _transaction(db):
                busy = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN "
                                  f"({','.join('?' * len(ACTIVE))})", (file_id, *ACTIVE)).fetchone()
                if busy is None:
                    db.execute("DELETE FROM files WHERE id = ?", (file_id,))
                return busy["id"] if busy else None
        return await self.run(delete)

    # --- batches -----------------------------------------------------------------------------

    async def add_batch(self, row: dict[str, Any]) -> None:
        await self.run(_insert, "batches", row)

    async def batch(self, batch_id: str) -> dict[str, Any] | None:
        return await self.run(_one, "SELECT * FROM batches WHERE id = ?", (batch_id,))

    async def batches(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        """Newest first, as OpenAI lists them; `after`: the last id of the previous page."""
        if after is None:
            return await self.run(_all, "SELECT * FROM batches ORDER BY rowid DESC LIMIT ?", (limit,))
        return await self.run(_all, "SELECT * FROM batches WHERE rowid < (SELECT rowid FROM batches WHERE id = ?) "
                                    "ORDER BY rowid DESC LIMIT ?", (after, limit))

    async def active(self) -> list[str]:
        """Jobs still to drive, oldest first."""
        rows = await self.run(_all, f"SELECT id FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))}) "
                                    "ORDER BY rowid", ACTIVE)
        return [r["id"] for r in rows]

    async def update(self, batch_id: str, **fields: Any) -> None:
        await self.run(_update, batch_id, fields)

    async def move(self, batch_id: str, frm: tuple[str, ...], **fields: Any) -> bool:
        """Set `fields` if the job's status is one of `frm` (one transaction) -> whether it was."""
        def move(db: sqlite3.Connection) -> bool:
            sets = ", ".join(f"{k} = ?" for k in fields)
            cur = db.execute(f"UPDATE batches SET {sets} WHERE id = ? AND status IN ({','.join('?' * len(frm))})",
                             (*fields.values(), batch_id, *frm))
            return cur.rowcount == 1
        return await self.run(move)

    async def finish(self, batch_id: str, files: list[dict[str, Any]], **fields: Any) -> None:
        """A job's end: its output files become files of the API and its row says so, together."""
        def finish(db: sqlite3.Connection) -> None:
            with _transaction(db):
                for row in files:
                    _insert(db, "files", row)
                _update(db, batch_id, fields)
        await self.run(finish)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """Statements that take effect together (the connection is in autocommit mode otherwise)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _insert(db: sqlite3.Connection, table: str, row: dict[str, Any]) -> None:
    db.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))


def _update(db: sqlite3.Connection, batch_id: str, fields: dict[str, Any]) -> None:
    db.execute(f"UPDATE batches SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
               (*fields.values(), batch_id))


def _one(db: sqlite3.Connection, sql: str, args: tuple) -> dict[str, Any] | None:
    row = db.execute(sql, args).fetchone()
    return dict(row) if row is not None else None


def _all(db: sqlite3.Connection, sql: str, args: tuple) -> list[dict[str, Any]]:
    return [dict(r) for r in db.execute(sql, args).fetchall()]
