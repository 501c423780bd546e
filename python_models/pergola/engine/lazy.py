"""LazyTensor: a device result on its way to a page-locked host buffer.

`step()` launches the forward pass, then an async device-to-host copy on the same stream,
and records an event after it. The event therefore means both "forward done" and "result on
host"; the caller prepares the next batch on the CPU and waits only when it needs the values.
"""

from __future__ import annotations

import numpy as np
import torch


class LazyTensor:
    def __init__(self, device_result: torch.Tensor, host_buffer: torch.Tensor | None = None,
                 tokens: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> None:
        """`tokens`: per-token rows [T, width] that come along (bge-m3's heads, when asked);
        `segments`: late chunking's atom sums [G, hidden]; each into a pinned buffer of PyTorch's
        caching host allocator (their size varies with the step)."""
        self._tokens, self._segments = tokens, segments
        if device_result.device.type == "cpu":
            self._host = device_result
            self._event = None
            return
        assert host_buffer is not None and host_buffer.is_pinned()
        rows = device_result.shape[0]
        self._host = host_buffer[:rows]
        self._host.copy_(device_result, non_blocking=True)
        self._tokens, self._segments = _to_pinned(tokens), _to_pinned(segments)
        self._event = torch.cuda.Event()
        self._event.record()

    def ready(self) -> bool:
        """True once the result is on the host (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> np.ndarray:
        """Block until the copy has landed; returns a view of the host buffer (copy it to keep it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()

    def tokens(self) -> np.ndarray | None:
        """The per-token rows [T, width] on the host, or None when the step was not asked for
        them; call after wait()."""
        return None if self._tokens is None else self._tokens.numpy()

    def segments(self) -> np.ndarray | None:
        """Late chunking's atom sums [G, hidden] on the host, or None when the step had no atoms;
        call after wait()."""
        return None if self._segments is None else self._segments.numpy()


def _to_pinned(device: torch.Tensor | None) -> torch.Tensor | None:
    """An async copy of `device` into pinned host memory (done when the step's event is)."""
    if device is None:
        return None
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    return host
