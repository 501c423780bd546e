"""CUDA graph capture without per-capture housekeeping (used by the graph cache and the probe)."""

from __future__ import annotations

from typing import Callable

import torch

_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture(graph: torch.cuda.CUDAGraph, fn: Callable[[], object], pool: tuple | None = None) -> None:
    """Record fn()'s kernels into `graph` on a side stream (capture is illegal on the default one).

    Unlike `torch.cuda.graph`, this skips the housekeeping before every capture: a device-wide
    synchronize and emptying the CUDA and pinned-host caches (plus gc.collect() on some torch
    versions). A probe that captures ~20 small graphs at start-up, or a lazy capture mid-serving,
    would pay that each time and re-allocate everything afterwards.
    """
    device = torch.cuda.current_device()
    stream = _capture_streams.get(device)
    if stream is None:
        stream = _capture_streams[device] = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
