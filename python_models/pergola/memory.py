"""Giving freed heap memory back to the system (glibc's malloc_trim).

Why: glibc keeps memory that large requests freed. Under traffic of varying shapes the
encoder's RSS climbs by hundreds of MB and stays there (freed tensor buffers left fragmented in
the heap; oneDNN's per-shape caches add to it), and a tokenizer stub keeps what its largest
requests took; a trim every few seconds of work keeps both flat (perf/soak.py, whose runs are in
perf/README.md's hardening table). The alternatives cost speed: a fixed MALLOC_MMAP_THRESHOLD_ (every
large tensor freshly mapped) or no oneDNN primitive cache slow CPU encoding; a trim costs a few ms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim  # noqa: B018 - glibc only (not musl, not macOS)
except (OSError, AttributeError):
    _libc = None


def trim() -> bool:
    """Return free heap memory to the system; False where the C library cannot."""
    return bool(_libc is not None and _libc.malloc_trim(0))


class HeapTrimmer:
    """Trim after `every_bytes` of work or `every_s` seconds, whichever comes first, and only
    then: trimming costs a heap walk, so not after every small request."""

    def __init__(self, every_bytes: int = 64 << 20, every_s: float = 10.0) -> None:
        self.every_bytes, self.every_s = every_bytes, every_s
        self._bytes, self._at = 0, time.monotonic()

    def after(self, nbytes: int) -> None:
        """Count `nbytes` of work done; trim if it is time."""
        self._bytes += nbytes
        now = time.monotonic()
        if self._bytes >= self.every_bytes or (self._bytes and now - self._at >= self.every_s):
            self.now(now)

    def now(self, at: float | None = None) -> None:
        trim()
        self._bytes, self._at = 0, at if at is not None else time.monotonic()
