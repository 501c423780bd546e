"""A batch's lines: the input file's request lines, checked; the output and error files' lines, as
OpenAI writes them; and which lines those files already answer (what a resumed job skips).

    in   {"custom_id": "a-1", "method": "POST", "url": "/v1/embeddings", "body": {...}}
    out  {"id": "batch_req_<batch>_<line>", "custom_id": "a-1",
          "response": {"status_code": 200, "request_id": "req_...", "body": {...}}, "error": null}
    err  the same with a status other than 2xx (the route's error envelope as body), or, for a line
         that is not a request, {"id", "custom_id" (null when it has none), "response": null,
         "error": {"code", "message"}}

Each record's `id` carries its input line number (1-based, blank lines counted), so the files
themselves say which lines are done: a job resumed after a crash reads them, and a line written
before the crash is never run again (gateway/batch/runner.py).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

# The routes a line may name, as the gateway serves them: url -> the API family of its errors
URLS = {"/v1/embeddings": "openai", "/v1/rerank": "cohere"}
MAX_LISTED_ERRORS = 100  # bad lines listed in the batch's `errors` (all of them are in the error file)


@dataclass(frozen=True)
class Line:
    number: int  # 1-based line of the input file
    custom_id: str
    url: str  # a key of URLS
    body: bytes  # the request's JSON body


@dataclass(frozen=True)
class BadLine:
    number: int
    custom_id: str | None
    message: str
    param: str | None = None
    code: str = "invalid_request"


def raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line that is not blank."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def parse(number: int, raw: bytes, seen: set[str] | None = None) -> Line | BadLine:
    """One input line as a request, or why it is not one (`seen`: the custom_ids before it)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return BadLine(number, None, f"line {number} is not valid JSON: {e}")
    if not isinstance(data, dict):
        return BadLine(number, None, f"line {number} must be a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(number, None, f"line {number}: `custom_id` must be a non-empty string", "custom_id")
    if seen is not None:
        if custom_id in seen:
            return BadLine(number, custom_id, f"line {number}: custom_id {custom_id!r} is used by an earlier line; "
                                              "each line needs its own", "custom_id", "duplicate_custom_id")
        seen.add(custom_id)
    if data.get("method", "POST") != "POST":
        return BadLine(number, custom_id, f"line {number}: `method` must be POST", "method")
    url = data.get("url")
    if url not in URLS:
        return BadLine(number, custom_id, f"line {number}: `url` must be one of {', '.join(URLS)}, got {url!r}",
                       "url")
    body = data.get("body")
    if not isinstance(body, dict):
        return BadLine(number, custom_id, f"line {number}: `body` must be a JSON object (the request)", "body")
    return Line(number, custom_id, url, orjson.dumps(body))


def line_id(batch_id: str, number: int) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_{number}"


def number_of(record_id: str) -> int:
    return int(record_id.rsplit("_", 1)[1])


def answer(batch_id: str, line: Line, status: int, body: bytes) -> bytes:
    """A record of the route's answer; `body` is its JSON as the route wrote it (spliced, not parsed again)."""
    head = orjson.dumps({"id": line_id(batch_id, line.number), "custom_id": line.custom_id})[:-1]
    request_id = f"req_{secrets.token_hex(12)}"
    return b'%s,"response":{"status_code":%d,"request_id":"%s","body":%s},"error":null}\n' % (
        head, status, request_id.encode(), body)


def refusal(batch_id: str, bad: BadLine) -> bytes:
    """A record of a line that never reached a route."""
    return orjson.dumps({"id": line_id(batch_id, bad.number), "custom_id": bad.custom_id, "response": None,
                         "error": {"code": bad.code, "message": bad.message}}) + b"\n"


def listed(bad: BadLine) -> dict:
    """A bad line as an entry of the batch's `errors.data` (the SDK's BatchError)."""
    return {"code": bad.code, "line": bad.number, "message": bad.message, "param": bad.param}


def append(path: Path, records: list[bytes]) -> None:
    """Add `records` to `path` and wait until they are on the disk (before the job counts them)."""
    if not records:
        return
    with open(path, "ab") as f:
        f.write(b"".join(records))
        f.flush()
        os.fsync(f.fileno())


def answered(path: Path) -> tuple[set[int], int]:
    """The input lines `path` holds a record of, and the tokens its answers used. A record cut short
    by a crash (the file's tail after its last newline) is removed: that line runs again."""
    numbers: set[int] = set()
    tokens = end = 0
    if not path.exists():
        return numbers, tokens
    with open(path, "r+b") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                f.truncate(end)
                os.fsync(f.fileno())
                break
            end += len(raw)
            record = orjson.loads(raw)
            numbers.add(number_of(record["id"]))
            body = (record.get("response") or {}).get("body") or {}
            tokens += int((body.get("usage") or {}).get("total_tokens") or 0)
    return numbers, tokens


def count_lines(path: Path) -> int:
    """Records in a job file (complete lines)."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
