"""Errors a client can act on, and the request limits checked before any work.

Adapters turn RequestError into Triton INVALID_ARG errors. Messages quote at most a short
prefix of what was sent (`quote`): an error that echoes a 10 MB input becomes a 10 MB HTTP
body, and over gRPC (where the message travels in a header) a RESOURCE_EXHAUSTED instead of
the error itself.
"""

from __future__ import annotations

from dataclasses import dataclass

QUOTE_CHARS = 40
MESSAGE_CHARS = 1000  # the longest error message sent back (gRPC's header limit is 8 KB)


class RequestError(ValueError):
    """A request pergola refuses; the message says what to change."""


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr() of `value`, or of its first `limit` characters with the full length said."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}... ({len(value):,} {unit})"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "..."


def bounded(message: str, limit: int = MESSAGE_CHARS) -> str:
    """An error message cut to `limit` characters: the last guard against echoing input."""
    return message if len(message) <= limit else message[:limit] + f"... ({len(message):,} characters)"


@dataclass(frozen=True)
class StringLimits:
    """How many strings a request field may hold and how long they may be (EngineConfig's
    max_texts / max_documents, max_text_chars, max_request_chars)."""

    max_count: int
    max_chars: int  # per string
    max_total_chars: int  # all strings of the request (the caller passes what other fields used)
    count_option: str = "max_texts"


def _over(what: str, size: int, limit: int, option: str, unit: str = "characters") -> RequestError:
    flag = "--" + option.replace("_", "-")
    return RequestError(f"{what} is {size:,} {unit}; the limit is {limit:,} characters ({option}, "
                        f"`pergola serve {flag}`): shorten or split it")


def read_strings(raw: list[bytes | str], name: str, noun: str, limits: StringLimits,
                 used_chars: int = 0) -> list[str]:
    """A request's strings (TEXT, DOCUMENTS, QUERY) decoded and checked before any tokenization:
    at least one, at most `max_count`, none empty, none and not all together over their limits,
    valid UTF-8. Sizes are checked on the bytes first (a character takes 1-4 bytes), so an
    oversized payload is refused without decoding it."""
    if not raw:
        raise RequestError(f"{name} is empty; send at least one {noun}")
    if len(raw) > limits.max_count:
        raise RequestError(
            f"{len(raw):,} {noun}s in one request; the limit is {limits.max_count:,} ({limits.count_option}): "
            "split them over several requests" if limits.max_count > 1 else
            f"{name} takes exactly one string, got {len(raw):,}")
    total_bytes = sum(len(item) for item in raw)
    if total_bytes > 4 * (limits.max_total_chars - used_chars):
        raise _over(f"this request's {name}", total_bytes, limits.max_total_chars, "max_request_chars", "bytes")
    out = []
    total = used_chars
    size_option = "max_text_chars" if limits.max_count > 1 else f"max_{noun}_chars"
    for i, item in enumerate(raw):
        what = f"{name}[{i}]" if limits.max_count > 1 else name
        if len(item) > 4 * limits.max_chars:
            raise _over(what, len(item), limits.max_chars, size_option, "bytes")
        text = item if isinstance(item, str) else _decode(item, what)
        if not text:
            raise RequestError(f"{what} is an empty string; every {noun} needs content")
        if len(text) > limits.max_chars:
            raise _over(what, len(text), limits.max_chars, size_option)
        total += len(text)
        out.append(text)
    if total > limits.max_total_chars:
        raise _over("this request's text", total, limits.max_total_chars, "max_request_chars")
    return out


def _decode(item: bytes, what: str) -> str:
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"{what} is not valid UTF-8 (byte {e.start}: {item[e.start:e.start + 4]!r}); "
                           "send text encoded as UTF-8") from None


def decode_utf8(raw: list[bytes], what: str = "TEXT") -> list[str]:
    """Decode short BYTES values (options such as PROMPT_NAME, ENCODING) strictly."""
    return [item if isinstance(item, str) else _decode(item, f"{what}[{i}]" if len(raw) > 1 else what)
            for i, item in enumerate(raw)]
