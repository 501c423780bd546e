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
