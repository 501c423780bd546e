"""Small steps' projection weights pulled into L2 ahead of their matmuls, on a side stream.

Why: a batch-1 step is a chain of small kernels, and its matmuls wait on HBM: at 16-128 tokens
each reads its whole weight (4-13 MB for Qwen3-0.6B) once, at 1.1-1.6 TB/s of the H100's 3.35,
because one wave of CTAs cannot keep enough loads in flight and the next kernel starts only when
this one ends (perf/results/2026-12-07-1ddb3b5/NOTES.md). Here a kernel of L2 prefetches, launched
on a side stream as each matmul is launched, asks for the weights of the matmuls after it while
it and the kernels between run, so a matmul finds its weight in L2. Nothing on the main stream
waits for the side stream, and a prefetch changes no value: the products are the same bits.

The window: when matmul i starts, the weights of matmuls i+1, i+2, ... are asked for as long as
their bytes fit in `budget` (default half the GPU's L2), each once; a weight over the budget is
never prefetched. The order is the projections' registration order within the transformer layers,
which is their call order (tests/test_prefetch.py checks it for every architecture); each projection
calls its `prefetch_hook` as it launches its matmul (pergola.layers.linear.Linear).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

from pergola.layers.fused import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(ptr, num_lines, LINE: tl.constexpr, LINES: tl.constexpr):
        # ptr: the weight's first element; one prefetch.global.L2 per 128-byte line (LINE elements),
        # LINES lines a program. Past the end the last line is asked for again (no masks in asm).
        lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
        ptrs = ptr + tl.minimum(lines, num_lines - 1).to(tl.int64) * LINE
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


LINE_BYTES = 128
LINES_PER_PROGRAM = 1024  # 4 warps x 32 threads x 8 prefetches: 128 KB a program, ~100 programs for 12 MB


def prefetch_l2(weight: torch.Tensor) -> None:
    """Ask for every 128-byte line of the contiguous `weight` in L2 (returns at once; no value changes)."""
    line = LINE_BYTES // weight.element_size()
    num_lines = -(-weight.numel() // line)
    grid = (-(-num_lines // LINES_PER_PROGRAM),)
    _prefetch_kernel[grid](weight, num_lines, LINE=line, LINES=LINES_PER_PROGRAM, num_warps=4)


def window_plan(sizes: Sequence[int], budget: int) -> tuple[list[int], list[list[int]]]:
    """sizes[i]: bytes of the weight matmul i reads, in call order -> (at_start, at): the indices
    to prefetch when the step starts, and at[i] those to prefetch as matmul i is launched.

    Each weight is asked for once, as soon as the bytes from the next matmul to run through it
    fit in `budget`; weights larger than the budget are left out (and do not hold the window)."""
    order = [i for i, size in enumerate(sizes) if size <= budget]
    taken = 0  # order[:taken] are asked for (or passed)

    def advance(first: int) -> list[int]:  # first: the next matmul to run
        nonlocal taken
        out = []
        while taken < len(order):
            j = order[taken]
            if j >= first:
                if sum(sizes[k] for k in order[:taken + 1] if k >= first) > budget:
                    break
                out.append(j)
            taken += 1
        return out

    at_start = advance(0)
    return at_start, [advance(i + 1) for i in range(len(sizes))]


class L2Prefetch:
    """Prefetches `weights` (in call order) for the steps run inside `step(True)`; see the module doc.

    Each thread has its own side stream: a step captured into a CUDA graph on one thread must not
    capture another thread's prefetches. The step joins the side stream back at its end, as a
    capture requires.
    """

    def __init__(self, modules: Sequence[nn.Module], budget: int) -> None:
        self.modules = list(modules)  # (weights are read at launch: FP8 swaps a module's weight after loading)
        self.budget = budget
        self.at_start, self.at = window_plan([_nbytes(m.weight) for m in self.modules], budget)
        self.launches = 0  # prefetch kernels launched (tests, logs)
        self._local = threading.local()
        for i, module in enumerate(self.modules):
            module.prefetch_hook = partial(self._launch, self.at[i])

    @property
    def prefetched_bytes(self) -> int:
        """Bytes one step asks for."""
        return sum(_nbytes(self.modules[i].weight) for i in self.at_start + [j for row in self.at for j in row])

    def _state(self) -> threading.local:
        local = self._local
        if not hasattr(local, "active"):
            local.active, local.side = False, None
        return local

    def _launch(self, indices: list[int]) -> None:
        local = self._state()
        if not local.active or not indices:
            return
        if local.side is None:
            local.side = torch.cuda.Stream()
        # The side stream waits for what the main stream has launched so far (the prefetch must not
        # run ahead of the step), never the other way round until the step ends.
        local.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(local.side):
            for i in indices:
                prefetch_l2(self.modules[i].weight)
        self.launches += len(indices)

    @contextmanager
    def step(self, on: bool) -> Iterator[None]:
        """Prefetch during the block when `on` (a step small enough to gain); nests (a query's step
        run between a large step's layers)."""
        local = self._state()
        outer = local.active
        local.active = on
        try:
            self._launch(self.at_start)
            yield
        finally:
            if on and local.side is not None:
                torch.cuda.current_stream().wait_stream(local.side)
            local.active = outer


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def prefetch_modules(layers: nn.ModuleList | None, linear_type: type) -> list[nn.Module]:
    """The projections (`linear_type` modules with a contiguous weight) of `layers`, in registration order."""
    if layers is None:
        return []
    return [m for m in layers.modules() if isinstance(m, linear_type) and m.weight.is_contiguous()]


def l2_prefetch(layers: nn.ModuleList | None, linear_type: type, device: torch.device,
                budget: int | None = None) -> L2Prefetch | None:
    """The prefetcher for the projections of `layers`, or None where it cannot run: no layers
    found, not a CUDA device, no Triton."""
    if device.type != "cuda" or not HAVE_TRITON:
        return None
    modules = prefetch_modules(layers, linear_type)
    if not modules:
        return None
    if budget is None:
        budget = torch.cuda.get_device_properties(device).L2_cache_size // 2
    return L2Prefetch(modules, budget)
