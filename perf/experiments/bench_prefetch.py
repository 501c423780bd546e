"""Does prefetching the next weight into L2 speed up batch-1 matmuls? Timed in CUDA graphs.

    python perf/experiments/bench_prefetch.py [--m 128] [--out prefetch.json]

The 112 matmuls of a Qwen3-0.6B forward (28 layers x qkv, o, gate_up, down; distinct weights,
0.88 GB) at M tokens, replayed from one CUDA graph after L2 has been flushed, four ways:
  chain      the matmuls alone (what a graph step runs today)
  +prefetch  each matmul forks an L2 prefetch of the next weight onto a side stream (per kernel config)
  warm L2    the same matmuls re-reading 4 weights (19 MB, L2-resident): the floor prefetching aims at
  prefetch   the prefetch kernels alone, as GB/s from HBM
Result on the H200 (perf/RESULTS.md): even fully L2-resident the chain takes 92% of its time
from HBM, and every prefetch configuration made it slower (1.18-4.5x), so the engine does not
prefetch; the kernel lives here with the experiment.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python_models"))
from pergola.cudagraph import capture  # noqa: E402
from pergola.layers.linear import linear  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down: [N, K]
CONFIGS = ["bulk,65536,128,4", "bulk,65536,32,1", "bulk,16384,32,1", "bulk,4096,32,1", "bulk,16384,8,1",
           "line,128,128,4", "line,128,256,8"]


@triton.jit
def _prefetch_kernel(ptr, nbytes, sink, CHUNK_BYTES: tl.constexpr, BULK: tl.constexpr, BLOCK: tl.constexpr):
    # ptr: the first byte of one weight, nbytes of it (a multiple of 16). Lane c prefetches
    # chunk c into L2; lanes past the end repeat the last chunk (the asm runs unpredicated).
    last = (nbytes - 1) // CHUNK_BYTES
    c = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), last)
    start = c.to(tl.int64) * CHUNK_BYTES
    addr = ptr + start
    if BULK:  # sm90+: one TMA bulk prefetch per chunk, no registers, no waiting
        size = tl.minimum(nbytes - start, CHUNK_BYTES).to(tl.int32)
        r = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                                      "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:  # one prefetch per 128-byte line
        r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
    # r is always 0 and nothing is stored; the masked store keeps the asm from being dropped.
    tl.store(sink + c, r, mask=r != 0)


@dataclass(frozen=True)
class PrefetchKernel:
    """How `_prefetch_kernel` splits a weight: `lanes` chunks of `chunk` bytes per CTA of `warps` warps."""

    bulk: bool = True  # cp.async.bulk.prefetch (sm90+) or prefetch.global per line
    chunk: int = 16 * 1024
    lanes: int = 32
    warps: int = 1

    @classmethod
    def parse(cls, text: str) -> "PrefetchKernel":
        """"bulk,16384,32,1" or "line,128,128,4": mode, chunk bytes, lanes, warps."""
        mode, chunk, lanes, warps = text.split(",")
        return cls(mode == "bulk", int(chunk), int(lanes), int(warps))

    def launch(self, weight: torch.Tensor, sink: torch.Tensor) -> None:
        nbytes = weight.numel() * weight.element_size() // 16 * 16  # bulk copies move 16-byte units
        grid = (triton.cdiv(triton.cdiv(nbytes, self.chunk), self.lanes),)
        _prefetch_kernel[grid](weight.view(-1).view(torch.uint8), nbytes, sink, CHUNK_BYTES=self.chunk,
                               BULK=self.bulk, BLOCK=self.lanes, num_warps=self.warps)


def timed(fn, flush: torch.Tensor, reps: int = 20) -> float:
    """Mean µs of fn() (a graph replay), L2 flushed before each run."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(reps):
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end) * 1000
    return total / reps


def graphed(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    capture(g, fn)
    return g


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
               for _ in range(args.layers) for n, k in SHAPES]
    inputs = {k: torch.randn(args.m, k, device=dev, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MB > L2: evicts everything
    nbytes = sum(w.numel() * 2 for w in weights)

    def chain(ws: list[torch.Tensor]) -> None:
        for w in ws:
            linear(inputs[w.shape[1]], w)

    results: dict[str, float] = {}
    results["chain"] = timed(graphed(lambda: chain(weights)).replay, flush)
    results["warm L2"] = timed(graphed(lambda: chain(weights[:4] * args.layers)).replay, flush)
    print(f"M={args.m}, {len(weights)} matmuls, {nbytes / 1e6:.0f} MB: chain {results['chain']:.0f} µs "
          f"({nbytes / results['chain'] / 1e6:.2f} TB/s), warm L2 {results['warm L2']:.0f} µs", flush=True)
    side = torch.cuda.Stream()
    sink = torch.zeros(1, dtype=torch.int32, device=dev)  # never written (see the kernel)
    for config in CONFIGS:
        kernel = PrefetchKernel.parse(config)

        def with_prefetch() -> None:
            # Before each matmul, fork: the side stream prefetches the weight of the matmul after it.
            main = torch.cuda.current_stream()
            for w, nxt in zip(weights, weights[1:] + [None]):
                if nxt is not None:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        kernel.launch(nxt, sink)
                linear(inputs[w.shape[1]], w)
            main.wait_stream(side)  # join (a capture requires it)

        try:
            alone = timed(graphed(lambda: [kernel.launch(w, sink) for w in weights]).replay, flush)
            both = timed(graphed(with_prefetch).replay, flush)
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run is reported and skipped
            print(f"{config}: failed ({type(e).__name__}: {e})", flush=True)
            continue
        results[f"+prefetch {config}"] = both
        results[f"prefetch {config}"] = alone
        print(f"{config}: chain+prefetch {both:.0f} µs ({both / results['chain']:.2f}x chain); prefetch alone "
              f"{alone:.0f} µs = {nbytes / alone / 1e6:.2f} TB/s", flush=True)
    best = min((k for k in results if k.startswith("+prefetch")), key=results.get, default=None)
    if best is not None:
        print(f"best: {best} {results[best]:.0f} µs vs chain {results['chain']:.0f} µs")
    if args.out:
        Path(args.out).write_text(json.dumps({"m": args.m, "bytes": nbytes, "us": results}, indent=1))


if __name__ == "__main__":
    main()
