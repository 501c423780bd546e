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
                 tokens: torch.Tensor | None = None) -> None:
        """`tokens`: per-token rows [T, width] that come along (bge-m3's heads, when asked), into
        a pinned buffer of PyTorch's caching host allocator (their size varies with the step)."""
        self._tokens = tokens
        if device_result.device.type == "cpu":
            self._host = device_result
            self._event = None
            return
        assert host_buffer is not None and host_buffer.is_pinned()
        rows = device_result.shape[0]
        self._host = host_buffer[:rows]
        self._host.copy_(device_result, non_blocking=True)
        if tokens is not None:
            self._tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._tokens.copy_(tokens, non_blocking=True)
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
