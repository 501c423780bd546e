"""Errors a client can act on. Adapters turn them into Triton INVALID_ARG errors."""


class RequestError(ValueError):
    """A request pergola refuses; the message says what to change."""


def decode_utf8(raw: list[bytes], what: str = "TEXT") -> list[str]:
    """Decode BYTES elements strictly, naming the first element that is not UTF-8."""
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            out.append(item)
            continue
        try:
            out.append(item.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(
                f"{what}[{i}] is not valid UTF-8 (byte {e.start}: {item[e.start:e.start + 4]!r}); "
                "send text encoded as UTF-8"
            ) from None
    return out


def check_strings(items: list[str], name: str, noun: str, limit: int) -> None:
    """A request's list of strings (TEXT, DOCUMENTS): at least one, at most `limit`, none empty."""
    if not items:
        raise RequestError(f"{name} is empty; send at least one {noun}")
    if len(items) > limit:
        raise RequestError(
            f"{len(items)} {noun}s in one request; the limit is {limit}: split them over several "
            "requests (or raise max_texts when building the repository)"
        )
    for i, item in enumerate(items):
        if not item:
            raise RequestError(f"{name}[{i}] is an empty string; every {noun} needs content")
