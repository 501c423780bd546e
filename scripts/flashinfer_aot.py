"""Build FlashInfer's ragged-prefill modules ahead of time, for hosts that must not compile them.

    FLASHINFER_CUDA_ARCH_LIST="8.0 8.9 9.0a" python scripts/flashinfer_aot.py OUT fa2:64 fa3:128 \
        --dtypes bfloat16 float16

Each TEMPLATE:HEAD_DIM (and dtype) is the module pergola's flashinfer_fa2 / flashinfer_fa3 backends
load (pergola.layers.flashinfer_modules.prefill_spec), built with nvcc and copied to OUT/<name>/<name>.so. FlashInfer loads <site-packages>/flashinfer/data/aot/
<name>/<name>.so before compiling anything, so OUT's contents go there on the serving host
(scripts/gpu_setup.sh does it for the GPU bundle, the Dockerfile for the image). Without them the
start-up probe leaves FlashInfer out (attention.flashinfer_ready): compiling takes 20-70 s a module.

Needs flashinfer-python, torch and pergola.layers.flashinfer_modules importable (PYTHONPATH=
python_models) and CUDA_HOME with nvcc; no GPU. Used by
scripts/gpu_bundle.py and the Dockerfile's flashinfer stage.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def build(out: Path, modules: list[tuple[str, int]], dtypes: list[str]) -> list[Path]:
    """-> the .so files copied into `out`, one per module and dtype."""
    import torch
    from pergola.layers.flashinfer_modules import prefill_spec

    built = []
    for template, head_dim in modules:
        for name in dtypes:
            dtype = getattr(torch, name)
            spec = prefill_spec(template, head_dim, dtype)
            print(f"  nvcc: {spec.name} ({template}, head_dim {head_dim}, {name})", flush=True)
            spec.build(verbose=False)
            lib = Path(spec.jit_library_path)
            dest = out / lib.parent.name / lib.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib, dest)
            built.append(dest)
    return built


def module(text: str) -> tuple[str, int]:
    template, _, dim = text.partition(":")
    if template not in ("fa2", "fa3") or not dim.isdigit():
        raise argparse.ArgumentTypeError(f"TEMPLATE:HEAD_DIM with TEMPLATE fa2 or fa3, got {text!r}")
    return template, int(dim)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder for <name>/<name>.so")
    ap.add_argument("modules", nargs="+", type=module, metavar="TEMPLATE:HEAD_DIM")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    args = ap.parse_args()
    for lib in build(args.out, args.modules, args.dtypes):
        print(lib, flush=True)


if __name__ == "__main__":
    main()
