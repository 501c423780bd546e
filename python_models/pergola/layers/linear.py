"""Matmuls y = x @ W^T of the decoder layers: cuBLAS, or a Triton kernel where it measured faster.

Why a second kernel at all: at batch-1 sizes (M ~ 128 tokens) cuBLAS tiles the output 128 x 128,
so the 1024-column o/down projections of Qwen3-0.6B run as 8 CTAs on 132 SMs and read their
weights at ~0.7 TB/s of the H200's 4.8. Narrow Triton tiles (BN 32-64) put 64-256 CTAs on the
same matmul. `gated` is gate_up + SiLU*mul in one kernel (two accumulators per tile), which
saves the [M, 2I] round trip through memory at every M.

Which kernel and tile serve which M is a table measured on the GPU (`perf/bench_gemm.py` prints
it); shapes the table does not cover, and every CPU call, take the PyTorch path. Numerics are
the reference's: fp32 accumulation, one rounding to the model dtype; `gated` rounds gate and up
to the dtype before SiLU, as HF's separate ops do.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pergola.layers.fused import HAVE_TRITON, silu_and_mul, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl


@dataclass(frozen=True)
class Tile:
    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 4

    def fits(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % self.bk == 0

    def __str__(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}/w{self.warps}s{self.stages}"


# "kind:NxK" -> [(largest M, tile or None for cuBLAS)] in increasing M; past the last row, and
# for shapes not listed, cuBLAS (+ the SiLU kernel) runs. Measured by perf/bench_gemm.py on the
# H200 (perf/RESULTS.md, "Matmul kernels"); `PERGOLA_TRITON_TILES=file.json` (what bench_gemm
# --write-tiles writes) replaces the table, e.g. with one measured on another GPU.
TileTable = dict[str, list[tuple[int, Tile | None]]]
# H200, Qwen3-0.6B projections, 2026-12-02 (perf/results/2026-12-02-session3/gemm.log): Triton won
# only at M <= 64 (gate_up+SiLU 7.6 -> 6.1 µs at M=16, 7.9 -> 6.6 at 64; qkv 5.4 -> 5.2 at 64).
# From M = 128 cuBLAS (nvjet) wins every shape; at M = 16k Triton is 17-34% slower, which is
# more than the fused SiLU saves, so large steps stay on cuBLAS + the SiLU kernel.
SM90_TILES: TileTable = {
    "plain:4096x1024": [(16, None), (64, Tile(64, 32, 128))],
    "gated:3072x1024": [(16, Tile(16, 32, 128)), (64, Tile(64, 32, 128))],
}


def table_key(kind: str, n: int, k: int) -> str:
    return f"{kind}:{n}x{k}"


def load_tiles(path: str) -> TileTable:
    with open(path) as f:
        raw = json.load(f)
    return {key: [(int(m), None if t is None else Tile(**t)) for m, t in rows] for key, rows in raw.items()}


def dump_tiles(table: TileTable, path: str) -> None:
    raw = {key: [(m, None if t is None else asdict(t)) for m, t in rows] for key, rows in table.items()}
    with open(path, "w") as f:
        json.dump(raw, f, indent=1)


def tiles_for(matmul: str, device: torch.device) -> TileTable:
    """The table an engine uses: `matmul` is "auto", "cublas" or a table file (EngineConfig.matmul).

    "auto": PERGOLA_TRITON_TILES if set, else the built-in table on sm90 GPUs, else none.
    """
    if matmul == "cublas" or device.type != "cuda":
        return {}
    if matmul != "auto":
        return load_tiles(matmul)
    if os.environ.get("PERGOLA_TRITON_TILES"):
        return load_tiles(os.environ["PERGOLA_TRITON_TILES"])
    return SM90_TILES if torch.cuda.get_device_capability(device) == (9, 0) else {}


_active: TileTable = {}  # the table of the forward being traced or run eagerly (see use_tiles)


@contextlib.contextmanager
def use_tiles(table: TileTable) -> Iterator[None]:
    """Make `table` the one `linear` / `gated_linear` consult, for one engine's forward.

    A forward runs on one thread at a time and graph replays never call back into Python, so a
    module-level slot set around the forward lets two engines in one process use two tables.
    """
    global _active
    previous, _active = _active, table
    try:
        yield
    finally:
        _active = previous


def pick_tile(table: TileTable, kind: str, m: int, n: int, k: int) -> Tile | None:
    for max_m, tile in table.get(table_key(kind, n, k), ()):
        if m <= max_m:
            return tile if tile is not None and tile.fits(n, k) else None
    return None


def _triton_tile(x: torch.Tensor, kind: str, n: int, k: int) -> Tile | None:
    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    return pick_tile(_active, kind, x.shape[0], n, k)


if HAVE_TRITON:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, GATE_OFFSET,
                       GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # x [M, K], W [N_w, K] (row n of W is output column n), y [M, N]. N % BN == K % BK == 0.
        # GATED: y[:, n] = silu(x @ W[n]) * (x @ W[n + GATE_OFFSET]), W holding gate | up rows.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        m_ok = (rm < M)[:, None]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # [BM, BK]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # [BK, BN], a view of W^T
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            a = tl.load(x_ptrs, mask=m_ok, other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs), acc)
            if GATED:
                acc_up = tl.dot(a, tl.load(w_ptrs + GATE_OFFSET * stride_wn), acc_up)
            x_ptrs += BK
            w_ptrs += BK
        dt = y_ptr.dtype.element_ty
        if GATED:
            gate = acc.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            out = (act * acc_up.to(dt).to(tl.float32)).to(dt)
        else:
            out = acc.to(dt)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=m_ok)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, tile: Tile, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N_w, K]^T with a given tile; gated: weight is gate | up, y is [M, N_w / 2]."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if not tile.fits(n, k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"tile {tile} does not fit a [{m}, {k}] x [{n}, {k}] matmul")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (n // tile.bn, triton.cdiv(m, tile.bm))
    _linear_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), n, GATED=gated,
                         BM=tile.bm, BN=tile.bn, BK=tile.bk, num_warps=tile.warps, num_stages=tile.stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N]: the measured-fastest kernel for this M, else cuBLAS."""
    tile = _triton_tile(x, "plain", weight.shape[0], weight.shape[1])
    return F.linear(x, weight) if tile is None else triton_linear(x, weight, tile)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) for weight = gate | up [2I, K]: [M, K] -> [M, I]."""
    tile = _triton_tile(x, "gated", weight.shape[0] // 2, weight.shape[1])
    return silu_and_mul(F.linear(x, weight)) if tile is None else triton_linear(x, weight, tile, gated=True)
