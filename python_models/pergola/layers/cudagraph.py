"""CUDA graph capture without per-capture housekeeping (used by the graph cache and the probe)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_capture_streams: dict[int, torch.cuda.Stream] = {}
_blas_ready = threading.local()  # .streams: the capture streams this thread has run a matmul on


def warm_blas(stream: torch.cuda.Stream) -> None:
    """Create this thread's cuBLAS and cuBLASLt handles, and their workspaces on `stream`, eagerly.

    PyTorch makes them on a thread's first matmul (and a workspace per stream); made inside a
    capture, cublasCreate fails (CUBLAS_STATUS_NOT_INITIALIZED) and the capture is invalidated
    (cudaErrorStreamCaptureInvalidated). That happens when a step's eager warm-up ran on one
    thread (execute()'s, a query answered at once) and its capture on another (the encode loop's).
    """
    done = getattr(_blas_ready, "streams", None)
    if done is None:
        done = _blas_ready.streams = set()
    if stream.cuda_stream in done:
        return
    with torch.cuda.stream(stream):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.ones(16, 16, device=stream.device, dtype=dtype)
            torch.nn.functional.linear(x, x, x[0])  # cuBLASLt (bias epilogue)
            torch.mm(x, x)  # cuBLAS
    done.add(stream.cuda_stream)


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
    warm_blas(stream)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(*(() if pool is None else (pool,)))
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
