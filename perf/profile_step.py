"""Where one engine step spends GPU time: torch.profiler over a few steps of a given shape.

    python perf/profile_step.py --model qwen3-0.6b --seqs 32 --length 512
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import model_folder, profile_step  # noqa: E402
from inputs import TokenWindows  # noqa: E402

from pergola.config import EngineConfig  # noqa: E402
from pergola.engine import Engine  # noqa: E402
from pergola.hf_folder import load_model_spec  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="qwen3-0.6b")
p.add_argument("--seqs", type=int, default=32)
p.add_argument("--length", type=int, default=512)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--workdir", default=None)
p.add_argument("--matmul", default="auto", help="EngineConfig.matmul: auto, cublas or a tile-table file")
args = p.parse_args()
folder = model_folder(args.model, Path(args.workdir or tempfile.mkdtemp()))
engine = Engine(EngineConfig(model_dir=str(folder), device="cuda", matmul=args.matmul))
seqs = TokenWindows(load_model_spec(folder).tokenizer_file).ids(args.length, args.seqs, seed=1)
print(f"{args.model}: {args.seqs} x {args.length} tokens, {args.steps} calls, matmul={args.matmul}")
print(profile_step(engine, seqs, steps=args.steps))
