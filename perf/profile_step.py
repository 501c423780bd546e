"""Where one engine step spends GPU time: torch.profiler over a few steps of a given shape.

    python perf/profile_step.py --model qwen3-0.6b --seqs 32 --length 512
    python perf/profile_step.py --seqs 1 --length 128 --grid   # + each kernel's grid: CTAs vs the SMs
    python perf/profile_step.py --seqs 1 --length 128 --grid --option fold_norms=False   # another setting
"""

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_folder, parse_variants, pergola_embed, profile_step, sync  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.engine import Engine  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="qwen3-0.6b")
p.add_argument("--seqs", type=int, default=32)
p.add_argument("--length", type=int, default=512)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--workdir", default=None)
p.add_argument("--matmul", default="auto", help="EngineConfig.matmul: auto, cublas or a tile-table file")
p.add_argument("--option", action="append", default=[], metavar="FIELD=VALUE",
               help="an EngineConfig field for this run (repeatable), e.g. fold_norms=False")
p.add_argument("--grid", action="store_true",
               help="also list every kernel of one call with its grid (CTAs) against the GPU's SM count")
args = p.parse_args()


def kernel_grids(engine: Engine, seqs) -> str:
    """One warm call's kernels grouped by (name, grid), most time first: how many CTAs each launches.

    A kernel with fewer CTAs than the GPU has SMs leaves SMs idle; at batch 1 that is the question
    for the matmuls (torch.profiler's trace gives each kernel's grid and block)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        pergola_embed(engine, seqs)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pergola_embed(engine, seqs)
        sync()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            grid = e.get("args", {}).get("grid", [0, 0, 0])
            groups[(e["name"][:70], grid[0] * grid[1] * grid[2])].append(e["dur"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    lines = [f"{sms} SMs; {sum(map(len, groups.values()))} kernels, "
             f"{sum(map(sum, groups.values())):.0f} us busy; {covered_us(spans):.0f} us covered by a kernel, "
             f"{spans[-1][1] - spans[0][0]:.0f} us first start to last end",
             f"{'kernel':70} {'CTAs':>6} {'n':>4} {'mean us':>8} {'total us':>9}"]
    for (name, ctas), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{name:70} {ctas:6d} {len(durs):4d} {sum(durs) / len(durs):8.2f} {sum(durs):9.1f}")
    return "\n".join(lines)


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The time at least one kernel runs, from sorted (start, end) spans: kernels launched with
    programmatic dependent launch overlap the one before, so their durations' sum counts twice."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        total += max(0.0, e - max(s, end))
        end = max(end, e)
    return total


folder = model_folder(args.model, Path(args.workdir or tempfile.mkdtemp()))
overrides = parse_variants([f"options:{','.join(args.option)}"])["options"] if args.option else {}
engine = Engine(EngineConfig(model_dir=str(folder), device="cuda", matmul=args.matmul, **overrides))
seqs = TokenWindows(load_model_spec(folder).tokenizer_file).ids(args.length, args.seqs, seed=1)
print(f"{args.model}: {args.seqs} x {args.length} tokens, {args.steps} calls, matmul={args.matmul}, "
      f"options {overrides}")
print(profile_step(engine, seqs, steps=args.steps))
if args.grid:
    print(kernel_grids(engine, seqs))
