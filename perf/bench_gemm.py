"""The decoder's matmuls at every token count: cuBLAS vs pergola's Triton tiles, on this GPU.

    python perf/bench_gemm.py --out perf/out/gemm.json --write-tiles perf/out/tiles.json

For each projection of a Qwen3 layer (default: the 0.6B shape) and each M (tokens in a step),
times cuBLAS (gate_up: cuBLAS + the SiLU*mul kernel) and each candidate Triton tile (split-K
ones at M <= 256), checks the Triton result against cuBLAS, and writes the table
`pergola.layers.linear` uses (a Triton tile where it beat cuBLAS by more than --margin, else
cuBLAS). Times are per call inside a CUDA graph that runs the matmul over one weight per layer in
turn (distinct weights, as in the model, so the L2 cache does not hold them), which is how the
engine runs it: launch gaps included.
gate_up runs as the model does with its norm folded (`--fold-norms`, the default): it reads the raw
residual stream and 1/rms is applied after the product (in the SiLU kernel or the tile's epilogue).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_models"))
from pergola.layers.fused import PendingNorm  # noqa: E402
from pergola.layers.linear import Tile, TileTable, dump_tiles, gated_linear, split_counters, table_key, triton_linear  # noqa: E402

M_VALUES = [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SMALL_TILES = [Tile(bm, bn, bk, 4, st) for bm in (16, 64, 128) for bn in (32, 64, 128) for bk in (64, 128)
               for st in (4,)]
# Split-K pointer tiles (small M): K / split per program, the last of a tile's programs adds the slices.
SPLIT_TILES = [Tile(bm, bn, bk, 4, 4, split=s) for bm in (16, 64, 128) for bn in (32, 64) for bk in (64, 128)
               for s in (2, 4, 8)]
LARGE_TILES = [Tile(128, 128, 64, 8, 3), Tile(128, 256, 64, 8, 3), Tile(128, 128, 64, 4, 4), Tile(64, 128, 64, 4, 4),
               Tile(128, 64, 64, 4, 4), Tile(256, 128, 64, 8, 3), Tile(128, 128, 128, 8, 3)]
# The persistent TMA kernel (gated: bn is the output width, so 128 means a 128 x 256 wgmma tile).
TMA_TILES = [Tile(bm, bn, bk, w, st, tma=True) for bm, bn, bk, w, st in
             [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
              (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (128, 128, 128, 8, 2)]]


def shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[str, int, int]]:
    """name -> (kind, N, K): y [M, N] = x [M, K] @ W^T; gated N is I (W holds gate | up, [2I, K])."""
    return {"qkv": ("plain", (heads + 2 * kv_heads) * head_dim, hidden), "o": ("plain", hidden, heads * head_dim),
            "gate_up": ("gated", inter, hidden), "down": ("plain", hidden, inter)}


def graph_time_us(fn, calls: int, replays: int = 5) -> float:
    """Mean µs per call of `fn(i)` for i in 0..calls-1, captured once in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up outside the capture (Triton compiles here)
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def candidates(m: int, pdl: bool) -> list[Tile]:
    """The tiles tried at M = m; pdl: each pointer tile also with programmatic dependent launch."""
    if m > 256:
        return LARGE_TILES + TMA_TILES
    small = SMALL_TILES + SPLIT_TILES
    return small + [replace(t, pdl=True) for t in small] if pdl else small


def bench_shape(kind: str, n: int, k: int, layers: int, margin: float, log,
                m_values: list[int] = M_VALUES, pdl: bool = False, hot: bool = False) -> tuple[list[dict], list]:
    w_rows = 2 * n if kind == "gated" else n
    distinct = 1 if hot else layers  # hot: every call reads one weight, which stays in L2
    weights = [torch.randn(w_rows, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(distinct)]
    weights *= layers // distinct
    rows, table = [], []
    for m in m_values:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if kind == "gated":  # as the model runs it: x the raw stream, the norm folded (1/rms after the matmul)
            def ref_fn(i, x=x):
                return gated_linear(x, weights[i], None, PendingNorm(x, 1e-6))
        else:
            def ref_fn(i, x=x):
                return F.linear(x, weights[i])
        ref = ref_fn(0).float()
        cublas = graph_time_us(ref_fn, layers)
        best: tuple[float, Tile | None] = (cublas, None)
        row = {"m": m, "cublas_us": cublas, "triton": {}}
        for tile in candidates(m, pdl):
            if not tile.fits(n, k) or tile.bm > 2 * max(m, 16):
                continue
            # split-K: arrival counts per weight, as each model projection keeps its own
            counters = [split_counters(((m, tile),), n, x.device) for _ in range(layers)]

            def fn(i, x=x, tile=tile, counters=counters):
                if kind == "gated":
                    return gated_linear(x, weights[i], tile, PendingNorm(x, 1e-6), counters[i])
                return triton_linear(x, weights[i], tile, counters=counters[i])
            try:
                got = fn(0).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                us = graph_time_us(fn, layers)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                row["triton"][str(tile)] = {"error": str(e)[:200]}
                continue
            row["triton"][str(tile)] = {"us": us, "max_rel_err": err}
            if err < 2e-2 and us < best[0]:
                best = (us, tile)
        won = best[1] is not None and best[0] < cublas * (1 - margin)
        table.append((m, best[1] if won else None))
        bytes_moved = 2 * (w_rows * k + m * k + m * n)
        row.update(best=str(best[1]) if won else "cublas", best_us=best[0] if won else cublas,
                   best_tbps=bytes_moved / (best[0] if won else cublas) / 1e6,
                   best_tflops=2 * m * w_rows * k / (best[0] if won else cublas) / 1e6)
        timed = [(r["us"], name) for name, r in row["triton"].items() if "us" in r and r["max_rel_err"] < 2e-2]
        fastest = min(((us, name) for us, name in timed if not name.endswith("/pdl")), default=(float("nan"), "-"))
        with_pdl = min(((us, name) for us, name in timed if name.endswith("/pdl")), default=None)
        log(f"  M={m:6d}  cuBLAS {cublas:8.2f} µs   best {row['best']:>18s} {row['best_us']:8.2f} µs  "
            f"({row['best_tbps']:.2f} TB/s, {row['best_tflops']:.0f} TFLOP/s)   fastest Triton {fastest[1]} "
            f"{fastest[0]:.2f} µs" + (f", with PDL {with_pdl[1]} {with_pdl[0]:.2f} µs" if with_pdl else ""))
        rows.append(row)
    return rows, table


def compact(rows: list) -> list:
    """Merge consecutive M rows with the same choice (the table's lookup takes the first M >= m)."""
    out: list = []
    for m, tile in rows:
        if out and out[-1][1] == tile:
            out[-1] = (m, tile)
        else:
            out.append((m, tile))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28, help="distinct weights per graph (the model's layers)")
    p.add_argument("--hot-weight", action="store_true",
                   help="every call of the graph reads one weight, which then stays in L2: against the default, "
                        "what reading weights from HBM costs these kernels (--layers 1 instead would time a "
                        "one-kernel graph, whose replay gaps count)")
    p.add_argument("--margin", type=float, default=0.03, help="Triton must beat cuBLAS by this fraction")
    p.add_argument("--only", nargs="*", default=None, help="projections to run (qkv o gate_up down)")
    p.add_argument("--m", nargs="*", type=int, default=M_VALUES, help="token counts (rows) to time")
    p.add_argument("--pdl", action="store_true",
                   help="also time each pointer tile launched with programmatic dependent launch (sm90+)")
    p.add_argument("--out", default="perf/out/gemm.json")
    p.add_argument("--write-tiles", default=None, help="write the chosen table as JSON (pergola serve --matmul FILE)")
    args = p.parse_args()
    torch.manual_seed(0)
    results, table = {}, {}
    t0 = time.time()
    for name, (kind, n, k) in shapes(args.hidden, args.inter, args.heads, args.kv_heads, args.head_dim).items():
        if args.only and name not in args.only:
            continue
        print(f"{name}: {kind} N={n} K={k}", flush=True)
        rows, chosen = bench_shape(kind, n, k, args.layers, args.margin, lambda s: print(s, flush=True), args.m,
                                   args.pdl, args.hot_weight)
        results[name] = {"kind": kind, "n": n, "k": k, "rows": rows}
        table[table_key(kind, n, k)] = compact(chosen)
    tiles: TileTable = {key: rows for key, rows in table.items() if any(t is not None for _, t in rows)}
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds": time.time() - t0,
            "command": " ".join(sys.argv)}
    readable = {key: [(m, str(t) if t else "cublas") for m, t in rows] for key, rows in table.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "shapes": results, "table": readable}, indent=1))
    if args.write_tiles:
        dump_tiles(tiles, args.write_tiles)
    print(json.dumps(readable, indent=1))


if __name__ == "__main__":
    main()
