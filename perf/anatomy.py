"""Anatomy of an engine call on the GPU: host time vs GPU busy time vs kernel time, by kernel kind.

    python perf/anatomy.py --shapes 1x128 100x4096 --variant cublas:matmul=cublas

For each engine variant and each shape (texts x tokens per call), it reports per call:
  wall     host time of `Engine.encode` (untraced timing, best of several rounds)
  busy     time at least one kernel or copy runs (union of intervals, from a torch.profiler trace)
  idle     wall - busy: the GPU waits for the host (launches, planning, syncs) or between kernels;
           "inside steps" is the part between the kernels of one step (a graph's dependent kernels)
  kernels  sum of kernel durations by kind (matmul, attention, norm, rope, act, other)
Where `busy` is far below `wall`, the host or inter-kernel gaps limit the call, not the kernels.
Also prints how long each engine took to start (weights, attention probe).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_folder, parse_variants, pergola_embed  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.engine import Engine  # noqa: E402

KINDS = [  # (kind, substrings of kernel names), first match wins (FlashInfer's FA3 is a CUTLASS kernel)
    ("attention", ("flash", "Prefill", "fmha", "attention", "Attention", "Attn")),
    # _linear_tma_kernel: large-M gate_up with SiLU*mul in its epilogue (no separate "act" kernel)
    ("matmul", ("nvjet", "gemm", "_linear_kernel", "_linear_tma_kernel", "splitKreduce", "cutlass", "sm90_xmma")),
    ("norm", ("rms_norm", "layer_norm")),
    ("rope", ("rope",)),
    ("act", ("silu", "act_and_mul", "gelu", "GeluCUDAKernel")),
]


TOP_KERNELS = 8  # the kernels (by name) that take the most time, per shape


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def device_events(prof) -> list[dict]:
    """The device's kernels, copies and memsets of a finished torch.profiler run, as chrome-trace
    events (ts and dur in µs on the device's clock; args.stream: the stream)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1e30
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def step_gaps_us(gpu: list[dict]) -> float:
    """Time inside steps when no kernel or copy runs (gaps between dependent kernels).

    A step ends with its device-to-host copy (the LazyTensor), so GPU events are cut into steps
    after each DtoH copy; a step's gap time is its span (first start to last end) minus its busy
    time. What the GPU idles between steps (host packing, planning, launching) is not counted.
    """
    steps: list[list[tuple[float, float]]] = [[]]
    for e in sorted(gpu, key=lambda e: e["ts"]):
        steps[-1].append((e["ts"], e["ts"] + e["dur"]))
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]:
            steps.append([])
    return sum(max(e for _, e in iv) - min(s for s, _ in iv) - union_us(iv) for iv in steps if iv)


def trace_calls(engine: Engine, seqs: list[np.ndarray], calls: int) -> dict:
    """Profile `calls` calls; -> per-call busy µs, kernel µs by kind, kernel count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            pergola_embed(engine, seqs)
        torch.cuda.synchronize()
    gpu = device_events(prof)
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in gpu:
        k = kind_of(e["name"]) if e["cat"] == "kernel" else "copy"
        by_kind[k] = by_kind.get(k, 0.0) + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"busy_us": union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu]) / calls,
            "step_gaps_us": step_gaps_us(gpu) / calls,
            "kernels_us": {k: v / calls for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernel_count": sum(e["cat"] == "kernel" for e in gpu) / calls,
            "top_kernels_us": {name[:120]: us / calls for name, us in top}}


def wall_us(engine: Engine, seqs: list[np.ndarray], calls: int, rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            pergola_embed(engine, seqs)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--shapes", nargs="+", default=["1x128", "1x512", "100x512", "100x4096"])
    p.add_argument("--variant", nargs="*", default=[], help="LABEL:field=value,... EngineConfig overrides")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    folder = model_folder(args.model, Path(args.workdir or tempfile.mkdtemp()))
    windows = TokenWindows(load_model_spec(folder).tokenizer_file)
    variants = {"default": {}} | parse_variants(args.variant)
    results: dict = {}
    for label, overrides in variants.items():
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model_dir=str(folder), device="cuda", **overrides))
        load_s = time.perf_counter() - t0
        print(f"[{label}] {overrides}: engine ready in {load_s:.2f} s ({engine.runner.startup})", flush=True)
        results[label] = {"overrides": overrides, "load_s": load_s, "startup": engine.runner.startup, "shapes": {}}
        probe = engine.runner.probe
        if probe is not None:  # what the start-up probe measured (µs per layer call) and chose
            results[label]["probe"] = {"micros": probe.micros, "graph_rules": probe.graph_rules, "eager": probe.eager}
            print(f"[{label}] attention probe: graphs {probe.graph_rules}, eager {probe.eager}; "
                  + "; ".join(f"{b}: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items())
                              for b, m in probe.micros.items()), flush=True)
        for shape in args.shapes:
            n, length = map(int, shape.split("x"))
            seqs = windows.ids(length, n, seed=1)
            calls = max(3, min(40, 40 * 1024 // (n * length)))
            for _ in range(3):  # warm-up, lazy graph capture
                pergola_embed(engine, seqs)
            wall = wall_us(engine, seqs, calls)
            traced = trace_calls(engine, seqs, calls)
            row = {"wall_us": wall, **traced, "idle_us": wall - traced["busy_us"]}
            results[label]["shapes"][shape] = row
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in traced["kernels_us"].items())
            print(f"[{label}] {shape}: wall {wall:.0f} µs, GPU busy {traced['busy_us']:.0f}, idle {row['idle_us']:.0f}"
                  f" ({row['idle_us'] / wall:.0%}); under the profiler {traced['step_gaps_us']:.0f} between kernels"
                  f" inside steps (CUPTI widens these gaps: an upper bound);"
                  f" {traced['kernel_count']:.0f} kernels: {kinds}", flush=True)
            for name, us in traced["top_kernels_us"].items():
                print(f"    {us:9.0f} µs  {name}", flush=True)
        del engine
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
