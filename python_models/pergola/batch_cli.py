"""`pergola batch INPUT --output OUTPUT --url GATEWAY`: a corpus through the gateway, resumable.

    INPUT    .parquet (a --text-column, an --id-column: default the row number)
             .jsonl   lines of the Batch API ({"custom_id", "url", "body"}), objects with the
                      text and id columns, or JSON strings (id: the line number)
             other    one text per line (id: the line number)
    OUTPUT   .parquet (id, vector: fixed-size list of float32), else JSONL ({"id", "embedding"}, or
             for Batch API lines the Batch API's output records)

Texts go in requests of --batch-size to /v1/embeddings (base64 answers), --concurrency of them
in flight; a Batch API line goes to its own `url` as it is. A refusal for load (429, 503) is
retried after its Retry-After (else a doubling backoff); a request refused for its input is
split until the texts at fault are alone, and those go to OUTPUT.errors.jsonl.

Resumable: answers are written as they come (JSONL appended; Parquet in parts under
OUTPUT.parts/, each written whole under a temporary name, merged into OUTPUT at the end), and a
second run skips every id already written, so an interrupted run (Ctrl-C, a crash, a lost
machine) is continued by running the same command again.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import os
import random
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

MAX_BACKOFF_S = 30.0


# --- input -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    id: Any  # the row's id (the Parquet column's type), or a Batch API line's custom_id
    text: str | None = None  # texts mode
    url: str | None = None  # Batch API lines: where the body goes
    body: bytes | None = None


def _first_line(path: Path) -> Any:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                return orjson.loads(raw)
    return None


def is_requests(path: Path) -> bool:
    """Whether INPUT holds Batch API lines (their answers are records, not vectors)."""
    if path.suffix != ".jsonl":
        return False
    first = _first_line(path)
    return isinstance(first, dict) and "custom_id" in first and "body" in first


def count_items(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def read_items(path: Path, text_column: str, id_column: str | None) -> Iterator[Item]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        source = pq.ParquetFile(path)
        columns = [text_column] + ([id_column] if id_column else [])
        missing = [c for c in columns if c not in source.schema_arrow.names]
        if missing:
            raise SystemExit(f"pergola batch: {path} has no column {missing[0]!r} (columns: "
                             f"{', '.join(source.schema_arrow.names)}); see --text-column / --id-column")
        row = 0
        for part in source.iter_batches(batch_size=8192, columns=columns):
            texts = part.column(text_column).to_pylist()
            ids = part.column(id_column).to_pylist() if id_column else range(row, row + len(texts))
            yield from (Item(i, t) for i, t in zip(ids, texts))
            row += len(texts)
        return
    jsonl = path.suffix == ".jsonl"
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if not jsonl:
                yield Item(number, raw.decode("utf-8").rstrip("\r\n"))
                continue
            data = orjson.loads(raw)
            if isinstance(data, str):
                yield Item(number, data)
            elif "custom_id" in data and "body" in data:
                yield Item(data["custom_id"], url=data.get("url", "/v1/embeddings"), body=orjson.dumps(data["body"]))
            else:
                yield Item(data.get(id_column or "id", number), data.get(text_column))


# --- output ----------------------------------------------------------------------------------

def _kept_lines(path: Path) -> list[bytes]:
    """The complete lines of a JSONL output; a tail cut short by a crash is removed."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end].splitlines()


class JsonlOutput:
    """Answers appended as they come: {"id", "embedding"}, or Batch API records as they are."""

    def __init__(self, path: Path, records: bool) -> None:
        self.path, self.records = path, records
        self.key = "custom_id" if records else "id"

    def written(self) -> set:
        return {orjson.loads(line)[self.key] for line in _kept_lines(self.path)}

    def add(self, rows: list[tuple[Any, Any]]) -> None:
        """rows: (id, vector) or (custom_id, record bytes)."""
        with open(self.path, "ab") as f:
            for key, value in rows:
                f.write(value if self.records else orjson.dumps({"id": key, "embedding": value},
                                                                option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def close(self) -> None:
        pass


class ParquetOutput:
    """(id, vector) rows in parts under OUTPUT.parts/, each written to a temporary name and
    renamed (a part is whole or absent), merged into OUTPUT by close()."""

    def __init__(self, path: Path, flush_rows: int) -> None:
        self.path, self.flush_rows = path, flush_rows
        self.parts = path.with_name(path.name + ".parts")
        self._ids: list = []
        self._vectors: list[np.ndarray] = []

    def _files(self) -> list[Path]:
        existing = [self.path] if self.path.exists() else []
        return existing + sorted(self.parts.glob("part-*.parquet")) if self.parts.exists() else existing

    def written(self) -> set:
        import pyarrow.parquet as pq

        return {i for f in self._files() for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()}

    def add(self, rows: list[tuple[Any, np.ndarray]]) -> None:
        for key, vector in rows:
            self._ids.append(key)
            self._vectors.append(vector)
        if len(self._ids) >= self.flush_rows:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not self._ids:
            return
        vectors = np.stack(self._vectors).astype(np.float32)
        table = pa.table({"id": pa.array(self._ids),
                          "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])})
        self.parts.mkdir(parents=True, exist_ok=True)
        number = len(list(self.parts.glob("part-*.parquet")))
        final = self.parts / f"part-{number:06d}.parquet"
        pq.write_table(table, final.with_suffix(".tmp"))
        os.replace(final.with_suffix(".tmp"), final)
        self._ids, self._vectors = [], []

    def close(self) -> None:
        """Every part (and an OUTPUT of an earlier run) into OUTPUT, one row group a part."""
        import pyarrow.parquet as pq

        self.flush()
        files = self._files()
        if not files or files == [self.path]:
            return
        merged = self.path.with_name(self.path.name + ".tmp")
        with pq.ParquetWriter(merged, pq.read_schema(files[0])) as writer:
            for f in files:
                writer.write_table(pq.read_table(f))
        os.replace(merged, self.path)
        shutil.rmtree(self.parts)


# --- requests --------------------------------------------------------------------------------

class Refused(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body[:300].decode(errors='replace')}")
        self.status, self.body = status, body


class Client:
    """POSTs to the gateway, retried under load (429, 503: Retry-After) and over lost connections."""

    def __init__(self, session: Any, url: str, api_key: str | None, retries: int) -> None:
        self.session, self.url, self.retries = session, url.rstrip("/"), retries
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.retried = 0  # refusals and lost connections retried (the summary says how many)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        import aiohttp

        delay = 0.5
        for attempt in itertools.count():
            wait = None
            try:
                async with self.session.post(self.url + path, data=body, headers=self.headers) as r:
                    data = await r.read()
                    if r.status not in (429, 503):
                        return r.status, data
                    wait = _retry_after(r.headers.get("Retry-After"))
                    if attempt >= self.retries:
                        return r.status, data
            except (TimeoutError, aiohttp.ClientConnectionError):
                if attempt >= self.retries:
                    raise
            self.retried += 1
            await asyncio.sleep(wait if wait is not None else delay * (0.5 + random.random()))
            delay = min(2 * delay, MAX_BACKOFF_S)
        raise AssertionError("unreachable")


def _retry_after(value: str | None) -> float | None:
    try:
        return min(float(value), MAX_BACKOFF_S) if value is not None else None
    except ValueError:
        return None


class Corpus:
    """One run: items not yet written -> requests -> the output."""

    def __init__(self, args: argparse.Namespace, client: Client, output: JsonlOutput | ParquetOutput,
                 failures: Path) -> None:
        self.args, self.client, self.output, self.failures = args, client, output, failures
        self.failed = 0
        self.options = {k: v for k, v in (("dimensions", args.dimensions), ("input_type", args.input_type),
                                          ("truncate", args.truncate)) if v is not None}

    async def embed(self, items: list[Item]) -> list[tuple[Any, np.ndarray]]:
        """Vectors of `items`; a request refused for its input is split until the texts at fault are alone."""
        body = orjson.dumps({"model": self.args.model, "input": [i.text for i in items], "encoding_format": "base64",
                             **self.options})
        status, data = await self.client.post("/v1/embeddings", body)
        if status == 200:
            rows = orjson.loads(data)["data"]
            return [(item.id, np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4"))
                    for item, row in zip(items, rows)]
        if len(items) > 1 and 400 <= status < 500 and status != 429:
            half = len(items) // 2
            return await self.embed(items[:half]) + await self.embed(items[half:])
        self._fail([(items[0].id, status, data)] if len(items) == 1 else [(i.id, status, data) for i in items])
        return []

    async def request(self, item: Item) -> list[tuple[Any, bytes]]:
        """A Batch API line, sent to its url -> its output record (or its error record)."""
        status, data = await self.client.post(item.url, item.body)
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:  # (a proxy's text page: carried as a string)
            data = orjson.dumps(data.decode(errors="replace"))
        record = orjson.dumps({"id": f"cli_req_{os.urandom(6).hex()}", "custom_id": item.id,
                               "response": {"status_code": status, "request_id": None, "body": orjson.Fragment(data)},
                               "error": None}) + b"\n"
        if status < 300:
            return [(item.id, record)]
        with open(self.failures, "ab") as f:
            f.write(record)
        self.failed += 1
        return []

    def _fail(self, rows: list[tuple[Any, int, bytes]]) -> None:
        with open(self.failures, "ab") as f:
            for key, status, data in rows:
                f.write(orjson.dumps({"id": key, "status": status, "error": data.decode(errors="replace")}) + b"\n")
        self.failed += len(rows)


async def _groups(items: Iterator[Item], size: int) -> AsyncIterator[list[Item]]:
    """`items` in lists of `size`, read on a thread (a large input file must not stall the requests)."""
    while True:
        group = await asyncio.to_thread(lambda: list(itertools.islice(items, size)))
        if not group:
            return
        yield group


async def run_corpus(args: argparse.Namespace, items: Iterator[Item], corpus: Corpus, bar: Any, records: bool) -> None:
    slots = asyncio.Semaphore(args.concurrency)
    running: set[asyncio.Task] = set()

    async def one(group: list[Item]) -> None:
        try:
            rows = await corpus.request(group[0]) if records else await corpus.embed(group)
            corpus.output.add(rows)
            bar.update(len(group))
        finally:
            slots.release()

    try:
        async for group in _groups(items, 1 if records else args.batch_size):
            await slots.acquire()
            task = asyncio.create_task(one(group))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
    finally:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def _run(args: argparse.Namespace, items: Iterator[Item], output: JsonlOutput | ParquetOutput,
               failures: Path, bar: Any, records: bool) -> Corpus:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        corpus = Corpus(args, Client(session, args.url, args.api_key, args.retries), output, failures)
        await run_corpus(args, items, corpus, bar, records)
        return corpus


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    source, target = Path(args.input), Path(args.output)
    if not source.exists():
        raise SystemExit(f"pergola batch: no input file {source}")
    records = is_requests(source)
    if records and target.suffix == ".parquet":
        raise SystemExit("pergola batch: Batch API lines are answered as JSONL records; name a .jsonl --output")
    output = ParquetOutput(target, args.flush_rows) if target.suffix == ".parquet" else JsonlOutput(target, records)
    failures = target.with_name(target.name + ".errors.jsonl")
    failures.unlink(missing_ok=True)  # (this run's failures: the rows in it are tried again)
    written = output.written()
    total = count_items(source)
    seen = set(written)

    def todo() -> Iterator[Item]:
        for item in read_items(source, args.text_column, args.id_column):
            if item.id not in seen:  # (written by an earlier run, or a repeated id: each id once)
                seen.add(item.id)
                yield item

    print(f"pergola batch: {len(written):,} of {total:,} already in {target}; the rest to {args.url}", file=sys.stderr)
    bar = tqdm(total=total, initial=min(len(written), total), unit="line" if records else "text", smoothing=0.05,
               dynamic_ncols=True, file=sys.stderr)
    try:
        corpus = asyncio.run(_run(args, todo(), output, failures, bar, records))
    except KeyboardInterrupt:
        if isinstance(output, ParquetOutput):
            output.flush()  # (what was answered is kept: the same command continues from here)
        raise SystemExit("\npergola batch: interrupted; run the same command again to continue") from None
    finally:
        bar.close()
    output.close()
    print(f"pergola batch: {target} complete ({corpus.client.retried} retries)", file=sys.stderr)
    if corpus.failed:
        raise SystemExit(f"pergola batch: {corpus.failed:,} refused, listed in {failures} (running the command "
                         "again tries them again)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="a .parquet, .jsonl (Batch API lines, objects or strings) or text file")
    p.add_argument("--output", required=True, help=".parquet (id, vector) or .jsonl; an existing one is continued")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway's base URL")
    p.add_argument("--model", default="embed", help="the served embedding model (texts)")
    p.add_argument("--text-column", default="text", help="the texts' column (Parquet, JSONL objects)")
    p.add_argument("--id-column", default=None, help="the ids' column (default: row number; JSONL objects: `id`)")
    p.add_argument("--batch-size", type=int, default=64, help="texts per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--flush-rows", type=int, default=10_000, help="Parquet: rows per part written (what an "
                                                                  "interruption may lose at most)")
    p.add_argument("--dimensions", type=int, default=None)
    p.add_argument("--input-type", default=None, help="query or document (the model's prompt)")
    p.add_argument("--truncate", default=None, help="END, START or NONE (default: the server's)")
    p.add_argument("--retries", type=int, default=30, help="tries again per request under load (429, 503) or "
                                                           "a lost connection")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
