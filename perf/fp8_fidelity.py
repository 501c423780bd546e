"""FP8 fidelity against BF16 (`--quantization fp8`): per-text cosine and a retrieval check.

    python perf/fp8_fidelity.py --models minilm qwen3-0.6b --out perf/out/fp8_fidelity.json
    python perf/fp8_fidelity.py --fp8-bf16-layers 0 1 2     # FP8 engines with 0, 1, 2 BF16 layers at each end

For each model, the same engine is built twice on the GPU, BF16 and FP8, and both embed one set
of texts: a corpus of passages cut from the documentation Python ships (`pydoc_data.topics`,
split at blank lines, whitespace collapsed, 200-1,200 characters) and queries that are the first
sentence of every fifth passage. Reported per model:
  - cosine FP8 vs BF16 per text (min, 1st percentile, mean) over queries and passages;
  - retrieval: each query ranks the passages by dot product (the embeddings are normalized) in
    BF16 and in FP8; top-10 overlap (shared passages / 10) per query, mean and min, and how often
    the top-1 passage is the same.

Models: all-MiniLM-L6-v2 with its real weights (the bundle's folder, `pergola.cli
.default_model_folder`), and the Qwen3-Embedding-0.6B shape with seeded random weights
(perf/common.model_folder). Seeded weights are weak evidence for quantization error: their
activations have none of the outlier channels and skewed ranges that trained models grow, which
is what makes per-token FP8 lose accuracy, so a good figure there says the arithmetic is right
rather than that a trained Qwen3 would keep its quality. Only MiniLM's figure speaks for real
weights.

`--device cpu` is a dry run on MiniLM: the FP8 layers run PyTorch's reference FP8 matmul on the
CPU (the engine's refusal lifted for this script), slowly; its figures stand for the arithmetic,
not for the GPU's kernels.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_folder  # noqa: E402
from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.engine import EncodeRequest, Engine  # noqa: E402
from pergola.outputs.pooling import finish  # noqa: E402
from pergola.text.tokenization import TextTokenizer  # noqa: E402


def corpus(max_passages: int, query_every: int = 5) -> tuple[list[str], list[str]]:
    """(passages, queries) from pydoc_data.topics: deterministic, shipped with every CPython."""
    from pydoc_data.topics import topics

    passages = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(block.split())
            if 200 <= len(text) <= 1200 and not set(text) <= set("*=-~ "):
                passages.append(text)
    passages = passages[:max_passages]
    queries = []
    for text in passages[::query_every]:
        first = re.split(r"(?<=[.?!])\s", text, maxsplit=1)[0]
        if len(first) >= 20:
            queries.append(first)
    return passages, queries


def embed(engine: Engine, texts: list[str], batch: int = 64) -> np.ndarray:
    tok = TextTokenizer(engine.spec)
    out = []
    for i in range(0, len(texts), batch):
        enc = tok.encode(texts[i:i + batch])
        pooled = engine.encode([EncodeRequest(enc.input_ids, enc.lengths)])[0]
        out.append(finish(pooled, 0, engine.spec.normalize))
    return np.concatenate(out)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def build_and_embed(label: str, folder: Path, device: str, passages: list[str], queries: list[str],
                    **options) -> tuple[np.ndarray, np.ndarray]:
    """(queries, passages) unit embeddings of one engine, freed afterwards."""
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=str(folder), device=device, dtype="bfloat16", **options))
    out = unit(embed(engine, queries)), unit(embed(engine, passages))
    print(f"{label}: {len(queries)} queries + {len(passages)} passages in {time.perf_counter() - t0:.1f} s", flush=True)
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def compare(name: str, folder: Path, device: str, passages: list[str], queries: list[str], k: int,
            bf16_layers: list[int]) -> list[dict]:
    """One row per fp8_bf16_layers value, each FP8 engine against the one BF16 reference."""
    qb, pb = build_and_embed(f"{name} bf16", folder, device, passages, queries)
    top_b = np.argsort(-(qb @ pb.T), axis=1)[:, :k]
    rows = []
    for keep in bf16_layers:
        qf, pf = build_and_embed(f"{name} fp8 (first/last {keep} in BF16)", folder, device, passages, queries,
                                 quantization="fp8", fp8_bf16_layers=keep)
        cos = np.concatenate([(qb * qf).sum(1), (pb * pf).sum(1)])
        top_f = np.argsort(-(qf @ pf.T), axis=1)[:, :k]
        overlap = np.array([len(set(a) & set(b)) / k for a, b in zip(top_b, top_f)])
        rows.append({"model": name, "fp8_bf16_layers": keep, "folder": str(folder), "texts": int(cos.size),
                     "queries": len(queries), "passages": len(passages), "k": k,
                     "cosine_fp8_vs_bf16": {"min": float(cos.min()), "p1": float(np.percentile(cos, 1)),
                                            "mean": float(cos.mean()),
                                            "argmin_text": (queries + passages)[int(cos.argmin())][:120]},
                     "topk_overlap": {"mean": float(overlap.mean()), "min": float(overlap.min())},
                     "top1_same": float((top_b[:, 0] == top_f[:, 0]).mean())})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["minilm", "qwen3-0.6b"], choices=["minilm", "qwen3-0.6b",
                                                                                     "qwen3-tiny"])
    p.add_argument("--passages", type=int, default=500, help="corpus size (passages of pydoc_data.topics)")
    p.add_argument("-k", type=int, default=10, help="top-k of the retrieval check")
    p.add_argument("--device", default="cuda", help="cuda; cpu: a dry run with the reference FP8 matmul")
    p.add_argument("--fp8-bf16-layers", nargs="+", type=int, default=[1], metavar="N",
                   help="FP8 engines with the first and last N layers in BF16, one row each (EngineConfig)")
    p.add_argument("--workdir", default=None, help="where the seeded Qwen3 folder goes")
    p.add_argument("--out", default="perf/out/fp8_fidelity.json")
    args = p.parse_args()
    if args.device == "cpu":
        import pergola.models.loader

        pergola.models.loader.check_supported = lambda device, dtype: None  # dry run: FP8 emulated on the CPU
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-fp8-"))
    passages, queries = corpus(args.passages)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (FP8 emulated, dry run)"
    rows = [row for m in args.models
            for row in compare(m, model_folder(m, workdir), args.device, passages, queries, args.k,
                               args.fp8_bf16_layers)]
    print(f"\nFP8 vs BF16 on {gpu}: {len(queries)} queries, {len(passages)} passages (pydoc_data.topics)")
    print(f"| model | BF16 layers at each end | cosine min | cosine p1 | cosine mean | top-{args.k} overlap mean | min "
          "| top-1 same |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        c, o = r["cosine_fp8_vs_bf16"], r["topk_overlap"]
        print(f"| {r['model']} | {r['fp8_bf16_layers']} | {c['min']:.4f} | {c['p1']:.4f} | {c['mean']:.4f} | "
              f"{o['mean']:.3f} | {o['min']:.1f} | {r['top1_same']:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu,
                               "torch": torch.__version__, "command": " ".join(sys.argv), "models": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
