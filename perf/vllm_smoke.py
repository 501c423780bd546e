"""A seconds-long check of a vLLM site on the GPU before minutes of suites: import vllm, print its version,
embed one 32-token input of the seeded Qwen3-Embedding-0.6B shape in process, all within --timeout.

    python perf/vllm_smoke.py --vllm-site /tmp/vllm-site-0.25.0     # or after: source SITE/env.sh

The model folder (perf/common.py's model_folder, seed 0, bf16, in --workdir; kept for the suites that
follow) is built first and outside the time bound; only vLLM's part is bounded. vLLM runs eager
(no torch.compile or CUDA graphs: a start-up of seconds, not the benchmark's configuration) with the
engine arguments perf/bench_vllm.py passes (runner="pooling", prefix caching off); vLLM 0.22.0 and
0.25.0 take the same (read in 0.25.0's wheel: engine/arg_utils.py, entrypoints/pooling/offline.py).
Exit 0 when the embedding is finite and of the model's width, else 1 (a timeout: 124).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "qwen3-0.6b"
WIDTH = 1024  # Qwen3-Embedding-0.6B's hidden size


def child(folder: str) -> int:
    """In the child, the vLLM site first on the path: import, load, embed once."""
    import numpy as np
    import vllm

    print(f"vllm_smoke: vllm {vllm.__version__} from {Path(vllm.__file__).parent}", flush=True)
    from vllm import LLM

    llm = LLM(model=folder, runner="pooling", dtype="bfloat16", enable_prefix_caching=False, enforce_eager=True,
              max_model_len=512, gpu_memory_utilization=0.5, seed=0)
    out = llm.embed([{"prompt_token_ids": list(range(100, 132))}], use_tqdm=False)
    emb = np.asarray(out[0].outputs.embedding, dtype=np.float32)
    ok = emb.shape == (WIDTH,) and bool(np.isfinite(emb).all())
    print(f"vllm_smoke: vllm {vllm.__version__}: embedding of {emb.shape[0]} values, norm {np.linalg.norm(emb):.4f}, "
          f"{'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE", "/tmp/vllm-site"),
                    help="the site scripts/vllm_setup.sh installed vLLM into ('' for vLLM already on the path)")
    ap.add_argument("--workdir", default="/tmp/pergola-archs", help="where the seeded model folder is built or found")
    ap.add_argument("--timeout", type=float, default=60, help="seconds for vLLM's import, start-up and one embed")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)

    from bench_vllm import kill_group, use_bundled_tokenizer, vllm_env
    from common import model_folder

    site = args.vllm_site or None
    use_bundled_tokenizer(site)
    folder = model_folder(MODEL, Path(args.workdir))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(folder)]
    proc = subprocess.Popen(cmd, env=vllm_env(site), start_new_session=True)  # its own group: the engine core too
    try:
        return proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"vllm_smoke: no embedding within {args.timeout:.0f} s", flush=True)
        return 124
    finally:
        kill_group(proc)  # leave no engine core behind


if __name__ == "__main__":
    sys.exit(main())
