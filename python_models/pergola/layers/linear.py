"""Projections y = x @ W^T of the models, on cuBLAS or a Triton kernel where it measured faster.

`Linear` and its fused forms (`MergedLinear` for q | k | v, `GateUpLinear` for gate | up + SiLU)
hold their weights in Hugging Face's layout, load checkpoint shards through their parameters'
`weight_loader`, and keep the rows of the tile table that match their shape (`select_tiles`, when
the model is built for a device): tiles depend only on (kind, N, K), M picks the row per call.

Why Triton kernels at all: (1) `gated` is gate_up + SiLU*mul in one kernel, which saves the [M, 2I]
round trip through memory: for large M a persistent TMA kernel whose wgmma tile spans BN gate and
BN up columns, faster than cuBLAS + the SiLU kernel from the table's crossover
(perf/results/2026-12-02-e5fe34e/NOTES.md). (2) At batch-1 sizes the pointer kernel's narrow tiles,
split-K and dependent launch put more CTAs on a matmul than cuBLAS's 128-wide ones; on the H100 they
won single matmuls by up to 15% but not the forward, so the built-in table leaves small M to cuBLAS
and they serve tables measured elsewhere (perf/results/2026-12-07-1ddb3b5/NOTES.md).

Which kernel and tile serve which M is a table measured on the GPU (`perf/bench_gemm.py` prints
it); shapes the table does not cover, and every CPU call, take the PyTorch path. Numerics are
the reference's: fp32 accumulation, one rounding to the model dtype; `gated` rounds gate and up
to the dtype before SiLU, as HF's separate ops do.

FP8 (`--quantization fp8`, pergola.layers.fp8): `Linear.to_fp8` swaps a projection's weight for
e4m3 + per-channel scales after loading; its forward then runs `fp8_linear` (no tiles).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pergola.layers.fp8 import Fp8Rows, fp8_linear, quantize_weight, silu_mul_quantize
from pergola.layers.fused import ACTIVATIONS, HAVE_TRITON, PendingNorm, rms_norm, silu_and_mul, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    try:  # Triton >= 3.4: host-side TMA descriptors
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        TensorDescriptor = None
    try:  # Triton >= 3.4: grid dependency control (programmatic dependent launch, sm90+)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        gdc_launch_dependents = gdc_wait = None


@dataclass(frozen=True)
class Tile:
    """One Triton matmul configuration. `tma`: the persistent kernel that streams x and W tiles
    with the Hopper tensor-memory accelerator (one CTA per SM walking output tiles), for large M;
    otherwise the plain one-CTA-per-tile kernel with pointer loads, for small M."""

    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 4
    tma: bool = False
    split: int = 1  # split-K: programs per output tile, each over K / split (pointer tiles only)
    # Programmatic dependent launch (pointer tiles, sm90+): the kernel may start while the one before
    # it finishes, pulls its weight slice toward L2, then waits for that kernel's output (_linear_kernel).
    pdl: bool = False

    def __post_init__(self) -> None:
        if self.split < 1 or (self.split > 1 and self.tma):
            raise ValueError(f"tile {self}: split-K needs split >= 1 and the pointer kernel")
        if self.pdl and self.tma:
            raise ValueError(f"tile {self}: dependent launch is for the pointer kernel")

    def fits(self, n: int, k: int) -> bool:
        return n % self.bn == 0 and k % (self.bk * self.split) == 0

    def output_tiles(self, m: int, n: int) -> int:
        """Output tiles of an [m, n] product: the split-K counters one call needs."""
        return -(-m // self.bm) * (n // self.bn)

    def __str__(self) -> str:
        split = f"/k{self.split}" if self.split > 1 else ""
        pdl = "/pdl" if self.pdl else ""
        return f"{'tma:' if self.tma else ''}{self.bm}x{self.bn}x{self.bk}/w{self.warps}s{self.stages}{split}{pdl}"


# "kind:NxK" -> [(largest M, tile or None for cuBLAS)] in increasing M; past the last row, and
# for shapes not listed, cuBLAS (+ the SiLU kernel) runs. `--matmul file.json` (what
# perf/bench_gemm.py --write-tiles writes) replaces the table, e.g. with one measured on another GPU.
TileTable = dict[str, list[tuple[int, Tile | None]]]
# Qwen3-0.6B projections. Small steps (M <= 512) run on cuBLAS (+ the SiLU kernel): in the forward of a
# 16- or 64-token step on an H100, cuBLAS alone took 963 / 966 µs of GPU time against 1,019 / 1,024 with
# pointer tiles for gate_up (whose folded norm costs the tile its lead) and split-K for down, and 970 / 976
# with the tiles bench_gemm measured fastest one by one, dependent launch included
# (perf/results/2026-12-07-1ddb3b5/NOTES.md). gate_up + SiLU on the persistent TMA kernel beats cuBLAS + the
# SiLU kernel from M = 1024 (H200, perf/results/2026-12-02-e5fe34e/NOTES.md); past 16384 (beyond the default
# step budget) the kernel is in the same compute-bound regime, so the last row extends it.
SM90_TILES: TileTable = {
    "gated:3072x1024": [(512, None), (1024, Tile(128, 64, 64, 4, 4, tma=True)),
                        (4096, Tile(128, 128, 64, 8, 4, tma=True)), (1 << 20, Tile(128, 128, 64, 8, 3, tma=True))],
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

    "auto": the built-in table on sm90 GPUs, else none.
    """
    if matmul == "cublas" or device.type != "cuda":
        return {}
    if matmul != "auto":
        return load_tiles(matmul)
    return SM90_TILES if torch.cuda.get_device_capability(device) == (9, 0) else {}


TileRows = tuple[tuple[int, Tile | None], ...]  # one projection's rows of a TileTable


def tile_rows(table: TileTable, kind: str, n: int, k: int) -> TileRows:
    """The rows of `table` for a [*, k] x [n, k] matmul; a tile that does not divide (n, k) becomes cuBLAS."""
    return tuple((m, tile if tile is not None and tile.fits(n, k) else None)
                 for m, tile in table.get(table_key(kind, n, k), ()))


def pick_tile(rows: TileRows, m: int) -> Tile | None:
    """The tile of the first row whose largest M covers `m`; None (cuBLAS) past the last row."""
    for max_m, tile in rows:
        if m <= max_m:
            return tile
    return None


if HAVE_TRITON:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym, GATE_OFFSET,
                       norm_eps, GATED: tl.constexpr, ACCUMULATE: tl.constexpr, ROW_NORM: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        # x [M, K], W [N_w, K] (row n of W is output column n), y [M, N]. N % BN == K % (BK * SPLIT) == 0.
        # GATED: y[:, n] = silu(x @ W[n]) * (x @ W[n + GATE_OFFSET]), W holding gate | up rows.
        # ACCUMULATE: y += x @ W^T (the residual add, in fp32, rounded once).
        # ROW_NORM: x is the raw residual stream and W holds an RMSNorm's gain (PendingNorm): the
        # products are scaled by each x row's 1/rms before the epilogue (the norm costs no kernel
        # of its own). The sum of squares has a loop of its own over x [BM, K] (a few KB, from
        # L2): summed from the `a` tiles of the pipelined dot loop (num_stages > 1), Triton 3.6
        # gave wrong sums for tiles of BM >= 64, while the same kernel with num_stages = 1 or the
        # separate loop was exact (perf/results/2026-12-06-5ad8bf1/NOTES.md).
        # SPLIT > 1 (split-K, for small M): program (n, m, s) sums K slice s into fp32 partials
        # ws [SPLIT, 2, M, N] (int32 offsets: the host keeps it under 2^31 elements); the last of a
        # tile's SPLIT programs to arrive (count_ptr, one int32 per output tile, left at 0 again)
        # adds the partials in slice order and runs the epilogue. Why: at M <= 64 an [M, 1024]
        # product has 16-32 output tiles for 132 SMs; split over K its weight streams from 2-4x as
        # many, with no second kernel to add the partials (cuBLAS's split-K runs one). The fixed
        # order keeps the result independent of which program arrives last. Measured on an H100:
        # down alone at M <= 64 ran up to 15% faster, the forward no faster than on cuBLAS
        # (perf/results/2026-12-07-1ddb3b5/NOTES.md).
        # PDL (launched with programmatic dependent launch): the next kernel may be scheduled at
        # once, and this one's weight slice (which no earlier kernel writes) is prefetched into L2
        # while the kernel before it runs; everything that reads an activation or writes comes after
        # gdc_wait, which returns once that kernel has finished and its writes are visible.
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        k_len = K // SPLIT
        rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        rk = pid_k * k_len + tl.arange(0, BK)
        if PDL:
            gdc_launch_dependents()
            _prefetch_l2(w_ptr + rn[:, None] * stride_wn + pid_k * k_len, k_len, BK)
            if GATED:
                _prefetch_l2(w_ptr + (rn[:, None] + GATE_OFFSET) * stride_wn + pid_k * k_len, k_len, BK)
            gdc_wait()
        m_ok = (rm < M)[:, None]
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # [BM, BK]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # [BK, BN], a view of W^T
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        sum_sq = tl.zeros((BM,), dtype=tl.float32)
        if ROW_NORM and SPLIT == 1:
            sum_sq = _row_sum_sq(x_ptr, rm, m_ok, stride_xm, K, BM, BK)
        for _ in range(0, k_len, BK):
            a = tl.load(x_ptrs, mask=m_ok, other=0.0)
            acc = tl.dot(a, tl.load(w_ptrs), acc)
            if GATED:
                acc_up = tl.dot(a, tl.load(w_ptrs + GATE_OFFSET * stride_wn), acc_up)
            x_ptrs += BK
            w_ptrs += BK
        last = True
        if SPLIT > 1:
            ws = ws_ptr + rm[:, None] * N + rn[None, :]  # slice 0's gate / plain part [BM, BN]
            part = 2 * M * N  # one slice: gate | up
            tl.store(ws + pid_k * part, acc, mask=m_ok)
            if GATED:
                tl.store(ws + pid_k * part + M * N, acc_up, mask=m_ok)
            tl.debug_barrier()  # every thread's partial is written before the arrival is counted
            tile = pid_m * tl.num_programs(0) + pid_n
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT - 1
            if last:
                acc = tl.zeros((BM, BN), dtype=tl.float32)
                acc_up = tl.zeros((BM, BN), dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # .cg: from L2, where the other programs wrote
                    acc += tl.load(ws + s * part, mask=m_ok, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(ws + s * part + M * N, mask=m_ok, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (and graph replay)
                if ROW_NORM:
                    sum_sq = _row_sum_sq(x_ptr, rm, m_ok, stride_xm, K, BM, BK)
        if last:
            if ROW_NORM:
                inv = tl.rsqrt(sum_sq / K + norm_eps)[:, None]
                acc = acc * inv
                acc_up = acc_up * inv
            y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
            if ACCUMULATE:
                acc += tl.load(y_ptrs, mask=m_ok, other=0.0).to(tl.float32)
            tl.store(y_ptrs, _epilogue(acc, acc_up, y_ptr.dtype.element_ty, GATED), mask=m_ok)

    @triton.jit
    def _prefetch_l2(row_ptrs, k_len, BK: tl.constexpr):
        # row_ptrs [R, 1] -> one L2 prefetch per 128-byte line of each row's k_len 16-bit elements
        ptrs = row_ptrs + (tl.arange(0, BK // 64) * 64)[None, :]  # [R, BK / 64]
        for _ in range(0, k_len, BK):
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
            ptrs += BK

    @triton.jit
    def _row_sum_sq(x_ptr, rm, m_ok, stride_xm, K, BM: tl.constexpr, BK: tl.constexpr):
        # sum over K of x[rm]^2 -> [BM] fp32 (the folded RMSNorm's statistic)
        s_ptrs = x_ptr + rm[:, None] * stride_xm + tl.arange(0, BK)[None, :]
        sum_sq = tl.zeros((BM,), dtype=tl.float32)
        for _ in range(0, K, BK):
            af = tl.load(s_ptrs, mask=m_ok, other=0.0).to(tl.float32)
            sum_sq += tl.sum(af * af, axis=1)
            s_ptrs += BK
        return sum_sq

    @triton.jit
    def _epilogue(acc, acc_up, dt, GATED: tl.constexpr):
        # fp32 accumulators -> the model dtype; gated: silu(gate) * up with HF's roundings.
        if GATED:
            gate = acc.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            return (act * acc_up.to(dt).to(tl.float32)).to(dt)
        return acc.to(dt)

    @triton.jit
    def _linear_tma_kernel(x_desc, w_desc, y_desc, M, N, K, GATED: tl.constexpr, ACCUMULATE: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACC_N: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
        # Persistent: NUM_SMS programs walk the [M / BM, N / BN] output tiles, GROUP_M row-tiles at
        # a time so the W tiles a group shares stay in L2. TMA loads x [BM, BK] and W tiles into
        # shared memory (rows past M read as zeros, stores past M are dropped), and the pipeliner
        # overlaps the next tile's loads with this tile's epilogue (flatten).
        # GATED: W is seen as [2, I, K] (gate | up), so one [2, BN, BK] load brings the gate rows
        # and the matching up rows, one [BM, 2 BN] dot multiplies both (the wgmma shape of a
        # 128 x 256 tile), and the epilogue writes silu(gate) * up [BM, BN]: the [M, 2I] product
        # never reaches memory. (Two accumulators fed by two loads ran slower: perf/results/2026-12-02-e5fe34e/.)
        start = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = N // BN
        per_group = GROUP_M * num_n
        for tile_id in tl.range(start, num_m * num_n, NUM_SMS, flatten=True):
            group = tile_id // per_group
            first_m = group * GROUP_M
            rows = min(num_m - first_m, GROUP_M)
            off_m = (first_m + tile_id % rows) * BM
            off_n = ((tile_id % per_group) // rows) * BN
            acc = tl.zeros((BM, ACC_N), dtype=tl.float32)
            for ki in range(K // BK):
                a = x_desc.load([off_m, ki * BK])
                if GATED:
                    acc = tl.dot(a, w_desc.load([0, off_n, ki * BK]).reshape(2 * BN, BK).T, acc)
                else:
                    acc = tl.dot(a, w_desc.load([off_n, ki * BK]).T, acc)
            if GATED:  # [BM, 2 BN] -> gate [BM, BN], up [BM, BN]
                gate, up = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
                y_desc.store([off_m, off_n], _epilogue(gate, up, y_desc.dtype, True))
            else:
                if ACCUMULATE:  # y += x @ W^T: the residual tile comes in through the same descriptor
                    acc += y_desc.load([off_m, off_n]).to(tl.float32)
                y_desc.store([off_m, off_n], _epilogue(acc, acc, y_desc.dtype, False))


def triton_linear(x: torch.Tensor, weight: torch.Tensor, tile: Tile, gated: bool = False,
                  out: torch.Tensor | None = None, norm_eps: float | None = None,
                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N_w, K]^T with a given tile; gated: weight is gate | up, y is [M, N_w / 2].

    out: a contiguous [M, N] tensor the product is added to in place (plain matmuls only).
    norm_eps: x is the raw residual stream and the weight holds an RMSNorm's gain; each product
    row is scaled by x's 1/rms (that norm's eps) before the epilogue (pointer tiles only).
    counters: a split-K tile's arrival counts, int32 zeros of at least tile.output_tiles(M, N)
    (`split_counters`; the kernel leaves them at zero); None allocates them for this call.
    """
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if not tile.fits(n, k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"tile {tile} does not fit a [{m}, {k}] x [{n}, {k}] matmul")
    if out is not None and (gated or out.shape != (m, n) or not out.is_contiguous()):
        raise ValueError(f"out= needs a plain matmul and a contiguous [{m}, {n}] tensor, got {tuple(out.shape)}")
    if norm_eps is not None and tile.tma:
        raise ValueError(f"tile {tile}: the persistent TMA kernel does not apply a pending norm")
    if tile.pdl and (gdc_wait is None or x.device.type != "cuda" or x.element_size() != 2):
        raise ValueError(f"tile {tile}: dependent launch needs Triton >= 3.4, a CUDA device and 16-bit operands")
    accumulate = out is not None
    y = out if accumulate else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if tile.tma:
        return _launch_tma(x, weight, y, tile, gated, accumulate)
    ws, counters = _split_buffers(tile, y, counters)
    grid = (n // tile.bn, triton.cdiv(m, tile.bm), tile.split)
    _linear_kernel[grid](x, weight, y, ws, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0), n,
                         0.0 if norm_eps is None else norm_eps, GATED=gated, ACCUMULATE=accumulate,
                         ROW_NORM=norm_eps is not None, BM=tile.bm, BN=tile.bn, BK=tile.bk, SPLIT=tile.split,
                         PDL=tile.pdl, num_warps=tile.warps, num_stages=tile.stages,
                         **({"launch_pdl": True} if tile.pdl else {}))
    return y


def split_counters(rows: TileRows, n: int, device: torch.device) -> torch.Tensor | None:
    """The arrival counts a projection's split-K rows need (int32 zeros, one per output tile of
    the largest M each covers), or None when no row splits. One per projection: a model's calls
    run in order on one stream, and each call leaves the counts at zero for the next."""
    sizes = [tile.output_tiles(max_m, n) for max_m, tile in rows if tile is not None and tile.split > 1]
    return torch.zeros(max(sizes), dtype=torch.int32, device=device) if sizes else None


def _split_buffers(tile: Tile, y: torch.Tensor,
                   counters: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials [split, 2, M, N] and the arrival counts of a split-K call into y [M, N]
    (y itself stands in for both where the tile does not split: the kernel never reads them)."""
    if tile.split == 1:
        return y, y
    m, n = y.shape
    if tile.split * 2 * m * n >= 1 << 31:  # the kernel's partial offsets are int32
        raise ValueError(f"tile {tile}: split-K is for small M; {m} x {n} outputs are too many for its partials")
    need = tile.output_tiles(m, n)
    if counters is None:
        counters = torch.zeros(need, dtype=torch.int32, device=y.device)
    elif counters.numel() < need or counters.dtype != torch.int32:
        raise ValueError(f"tile {tile}: an [{m}, {n}] product needs {need} int32 counters, got {counters.numel()}")
    return torch.empty(tile.split, 2, m, n, dtype=torch.float32, device=y.device), counters


def _launch_tma(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, tile: Tile, gated: bool,
                accumulate: bool) -> torch.Tensor:
    if TensorDescriptor is None:
        raise RuntimeError(f"tile {tile} needs Triton >= 3.4 (tensor descriptors); this is {triton.__version__}")
    (m, k), n = x.shape, y.shape[1]
    sms = _sm_count(x.device)
    x_desc = TensorDescriptor.from_tensor(x, [tile.bm, tile.bk])
    if gated:  # gate | up [2I, K] as [2, I, K]: one block = BN gate rows + the same BN up rows
        w_desc = TensorDescriptor(weight, [2, n, k], [n * k, k, 1], [2, tile.bn, tile.bk])
    else:
        w_desc = TensorDescriptor.from_tensor(weight, [tile.bn, tile.bk])
    y_desc = TensorDescriptor.from_tensor(y, [tile.bm, tile.bn])
    grid = (min(sms, triton.cdiv(m, tile.bm) * (n // tile.bn)),)
    _linear_tma_kernel[grid](x_desc, w_desc, y_desc, m, n, k, GATED=gated, ACCUMULATE=accumulate, BM=tile.bm,
                             BN=tile.bn, BK=tile.bk, ACC_N=tile.bn * (2 if gated else 1), GROUP_M=8, NUM_SMS=sms,
                             num_warps=tile.warps, num_stages=tile.stages)
    return y


def _sm_count(device: torch.device) -> int:
    """The SMs a persistent tile kernel spreads over: the device's (NUM_SMS is a constant of the kernel)."""
    if device.type != "cuda":  # Triton's interpreter (tests): a few programs, each walking several tiles
        return 3
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # cached by torch
    return sms


def linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
           tile: Tile | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] on `tile`, or cuBLAS when it is None.

    residual [M, N]: add the product to it in place and return it. The add happens in the
    matmul's epilogue (cuBLAS beta = 1 reads C while the tile is written; fp32 sum, one
    rounding), so the next RMSNorm reads one [M, N] tensor instead of two and writes one
    instead of two. In place on purpose: torch's out-of-place addmm first copies C to the output.
    counters: a split-K tile's arrival counts (`split_counters`).
    """
    if residual is None:
        return F.linear(x, weight) if tile is None else triton_linear(x, weight, tile, counters=counters)
    if tile is None:
        return residual.addmm_(x, weight.t())
    return triton_linear(x, weight, tile, out=residual, counters=counters)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None,
                 pending: PendingNorm | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) for weight = gate | up [2I, K]: [M, K] -> [M, I].

    pending: x is the raw residual stream (pending.x) and W holds the norm's gain; the 1/rms per
    row is applied by the SiLU kernel after cuBLAS or inside a pointer tile's epilogue. The
    persistent TMA tiles (large M) take the normalised x from an RMSNorm without gain instead.
    """
    if tile is None:
        return silu_and_mul(F.linear(x, weight), pending)
    if pending is None:
        return triton_linear(x, weight, tile, gated=True, counters=counters)
    if tile.tma:
        return triton_linear(rms_norm(x, None, pending.eps), weight, tile, gated=True)
    return triton_linear(x, weight, tile, gated=True, norm_eps=pending.eps, counters=counters)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """A checkpoint tensor that is the whole parameter."""
    param.data.copy_(loaded)


def shard_loader(output_sizes: list[int]) -> Callable[..., None]:
    """The weight_loader of a fused parameter: checkpoint part `shard_id` goes straight into its rows.

    A closure over the sizes, not a bound method: the parameter must not hold its module alive.
    """

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            raise ValueError(f"a fused parameter loads its {len(output_sizes)} parts one by one")
        param.data.narrow(0, sum(output_sizes[:shard_id]), output_sizes[shard_id]).copy_(loaded)

    return load


class Linear(nn.Module):
    """y = x @ W^T (+ bias): [M, in_features] -> [M, out_features], weight [out, in] as in nn.Linear.

    A projection without bias runs on the Triton tile its M picks from `tiles`, else cuBLAS; with
    a bias it is cuBLAS with the bias in the epilogue (no tile has one). After `to_fp8` the weight
    is e4m3 with `weight_scale` [1, out] and every call is one FP8 matmul (`fp8_linear`).
    """

    kind = "plain"  # the tile table's kind for this projection

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_buffer("weight_scale", None)  # [1, out] fp32 once the weight is FP8
        self.register_buffer("split_counters", None, persistent=False)  # int32, where a tile splits K
        self.tiles: TileRows = ()  # cuBLAS until select_tiles

    @property
    def output_columns(self) -> int:
        """N of this projection's matmul (the tile table's key)."""
        return self.weight.shape[0]

    def to_fp8(self) -> None:
        """Quantize the loaded weight to e4m3 with one scale per output row (in place, once)."""
        q, scale = quantize_weight(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        self.tiles = ()
        self.split_counters = None

    def select_tiles(self, table: TileTable) -> None:
        """Keep this projection's rows of `table` (tiles_for the device the model is built on)."""
        if self.bias is None and self.weight_scale is None:
            self.tiles = tile_rows(table, self.kind, self.output_columns, self.weight.shape[1])
            self.split_counters = split_counters(self.tiles, self.output_columns, self.weight.device)

    def tile(self, x: torch.Tensor) -> Tile | None:
        """The Triton tile for x [M, K], or None for cuBLAS (CPU, FP32, no row for this M)."""
        if not self.tiles or not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16):
            return None
        return pick_tile(self.tiles, x.shape[0])

    def forward(self, x: torch.Tensor | Fp8Rows, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, in] -> [M, out]; residual [M, out]: the product is added to it in place (`linear`).
        An FP8 projection also takes x already quantized (Fp8Rows)."""
        if self.weight_scale is not None:  # FP8: the bias rides in the matmul, the residual is one add
            y = fp8_linear(x, self.weight, self.weight_scale, self.bias)
            return y if residual is None else residual.add_(y)
        if self.bias is not None:
            y = F.linear(x, self.weight, self.bias)
            return y if residual is None else residual.add_(y)
        return linear(x, self.weight, residual, self.tile(x), self.split_counters)

    def activated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """ACTIVATIONS[act](x @ W^T + b): [M, in] -> [M, out].

        A 16-bit GELU projection with a bias on the GPU is one cuBLASLt matmul with the bias and
        GELU in its epilogue (GELU_BIAS) instead of a matmul and a GELU kernel: the [M, out]
        product is not written, read back and written again (bge-m3 in process: 4.8% faster at
        20 x 4,096 tokens, 7.8% at 100 x 512; perf/results/2026-12-07-7da946c/NOTES.md). The
        epilogue's GELU is the tanh form; for the exact (erf) "gelu" it differs by at most 4.7e-4
        (0.22% of any output above 0.05 in magnitude, under BF16's step of 0.4-0.8%), and it rounds
        once from fp32 where two kernels round twice.
        """
        if (act in GELU_EPILOGUE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
                and self.bias is not None and self.weight_scale is None):
            return torch._addmm_activation(self.bias, x, self.weight.t(), use_gelu=True)
        return ACTIVATIONS[act](self(x))


# The activations cuBLASLt's GELU_BIAS epilogue stands in for in 16 bits (Linear.activated).
GELU_EPILOGUE = ("gelu", "gelu_new", "gelu_pytorch_tanh")


class MergedLinear(Linear):
    """Projections of one input fused into one matmul: weight = W_0 | W_1 | ... along N.

    The checkpoint keeps them apart (q_proj, k_proj, v_proj); each is copied into its rows of the
    fused weight (and bias) as it is read.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = shard_loader(list(output_sizes))


class GateUpLinear(MergedLinear):
    """silu(x @ W_gate^T) * (x @ W_up^T): [M, in] -> [M, I], weight gate | up [2I, in], no bias."""

    kind = "gated"

    def __init__(self, in_features: int, intermediate_size: int) -> None:
        super().__init__(in_features, [intermediate_size, intermediate_size])

    @property
    def output_columns(self) -> int:
        return self.weight.shape[0] // 2

    def forward(self, x: torch.Tensor, pending: PendingNorm | None = None) -> torch.Tensor | Fp8Rows:
        """In FP8, silu(gate) * up comes out quantized for the down projection (Fp8Rows): SiLU,
        the product and the quantization are one kernel and [M, I] never goes to memory in BF16.
        pending: x is the raw residual stream and the weight holds the norm's gain (`gated_linear`)."""
        if self.weight_scale is not None:
            if pending is not None:
                raise ValueError("an FP8 gate_up projection does not take a folded norm")
            return silu_mul_quantize(fp8_linear(x, self.weight, self.weight_scale))
        return gated_linear(x, self.weight, self.tile(x), pending, self.split_counters)


def select_tiles(model: nn.Module, table: TileTable) -> None:
    """Give every projection of `model` its rows of `table`."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.select_tiles(table)
