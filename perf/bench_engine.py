"""Engine-level benchmark (no server): pergola's engine vs Hugging Face transformers, same GPU.

    python perf/bench_engine.py --models qwen3-0.6b minilm --out perf/out/engine.json

For each model: batch-1 latency (sequential, distinct real-text inputs) with CUDA graphs and
eagerly; throughput on 100 texts per call; the same through HF transformers (BF16, SDPA,
padded batches of 32, what sentence-transformers runs); outputs checked against HF first
(cosine); each attention backend timed alone per bucket; the bf16 matmul rate measured here
gives the compute limit.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    LAT_LENGTHS,
    TPUT_LENGTHS,
    HFBaseline,
    cosine_min,
    model_folder,
    parse_variants,
    pergola_embed,
    profile_step,
    sync,
    time_latency,
    time_throughput,
)
from inputs import TokenWindows  # noqa: E402
from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.engine import Engine  # noqa: E402
from pergola.layers.attention import AttentionMetadata, make_backend  # noqa: E402


# --- FLOPs and the compute limit ------------------------------------------------------------
def flops_per_token(cfg: dict, seq_len: int, causal: bool) -> float:
    """Forward FLOPs per token: dense matmuls + attention scores/values at this length."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    mlp_mats = 3 if cfg.get("model_type") == "qwen3" else 2
    dense = 2 * (h * (heads + 2 * kv) * d + heads * d * h + mlp_mats * h * inter)
    keys = seq_len / 2 if causal else seq_len
    attn = 2 * 2 * heads * d * keys
    return float(layers * (dense + attn))


def matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 matmul rate on random data (not zeros), the compute ceiling used here."""
    if common.DEVICE != "cuda":
        n = 1024
    a = torch.randn(n, n, device=common.DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=common.DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


# --- attention backends alone -----------------------------------------------------------------
def time_attention_backends(cfg: dict, causal: bool, names: list[str]) -> list[dict]:
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rows = []
    for num_seqs, length in [(1, 128), (1, 512), (1, 4096), (16, 128), (32, 512), (8, 2048)]:
        lengths = [length] * num_seqs
        t = num_seqs * length
        q = torch.randn(t, heads, d, device=common.DEVICE, dtype=torch.bfloat16)
        k = torch.randn(t, kv, d, device=common.DEVICE, dtype=torch.bfloat16)
        v = torch.randn(t, kv, d, device=common.DEVICE, dtype=torch.bfloat16)
        row = {"num_seqs": num_seqs, "seq_len": length}
        ref = None
        for name in names:
            try:
                t0 = time.perf_counter()
                attn = make_backend(name, torch.device(common.DEVICE), torch.bfloat16)
                meta = AttentionMetadata.build(lengths, torch.device(common.DEVICE), causal, padded=attn.needs_padding)
                meta.plan = attn.plan(meta.cu_seqlens.cpu(), heads, kv, d, causal)
                out = attn(q, k, v, meta)
                sync()
                setup_s = time.perf_counter() - t0
                ref = out if ref is None else ref
                err = float((out.float() - ref.float()).abs().max())
                t0 = time.perf_counter()
                for _ in range(20):
                    attn(q, k, v, meta)
                sync()
                row[name] = {"us": (time.perf_counter() - t0) / 20 * 1e6, "max_abs_diff": err, "setup_s": setup_s}
            except Exception as e:  # noqa: BLE001 - a backend missing here is a result too
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append(row)
    return rows


def bench_model(name: str, workdir: Path, args: argparse.Namespace, limit_tflops: float) -> dict:
    folder = model_folder(name, workdir)
    spec = load_model_spec(folder)
    windows = TokenWindows(spec.tokenizer_file)
    device = common.DEVICE
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=str(folder), device=device, dtype="bfloat16"))
    sync()
    load_s = time.perf_counter() - t0
    eager = Engine(EngineConfig(model_dir=str(folder), device=device, dtype="bfloat16", enforce_eager=True))
    # The same engine with other settings ("NAME:field=value,field=value"), timed side by side.
    variants, variant_errors = {}, {}
    for label, overrides in parse_variants(args.variant).items():
        try:
            variants[label] = Engine(EngineConfig(model_dir=str(folder), device=device, dtype="bfloat16", **overrides))
        except Exception as e:  # noqa: BLE001 - e.g. a kernel without a build for this head size
            variant_errors[label] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{name}: variant {label} unavailable: {variant_errors[label][:200]}", flush=True)
    hf = HFBaseline(folder, spec.pooling, spec.normalize)
    runner = engine.runner
    res: dict = {"model": name, "folder": str(folder), "engine_load_s": load_s, "latency": {}, "throughput": {},
                 "attention": {"graph": runner.attn.name, "eager": runner.eager_attn.name,
                               "in_use": runner.attention_in_use(),
                               "probe_us": None if runner.probe is None else runner.probe.micros},
                 "variants": parse_variants(args.variant), "variant_errors": variant_errors,
                 # each engine probes its attention kernels at load: a variant may choose others
                 "variant_attention": {label: var.runner.attention_in_use() for label, var in variants.items()}}
    print(f"{name}: loaded in {load_s:.1f} s; attention {res['attention']}", flush=True)
    n = args.latency_n
    for length in LAT_LENGTHS[name]:
        inputs = [[s] for s in windows.ids(length, 20, seed=length)]
        check = cosine_min(pergola_embed(engine, inputs[0]), hf(inputs[0]))
        lat = res["latency"][length] = {
            "pergola_eager": time_latency(functools.partial(pergola_embed, eager), inputs, n),
            "hf": time_latency(hf, inputs, max(n // 4, 10)),
            "min_cosine_vs_hf": check,
        }
        # The engine and its variants take turns, one request each, so that drift spreads evenly.
        engines = {"pergola_graph": engine, **variants}
        lat.update(common.time_latency_interleaved(
            {label: (lambda x, e=e: pergola_embed(e, x)) for label, e in engines.items()}, inputs, n))
        for label, var in variants.items():
            lat[label]["min_cosine_vs_hf"] = cosine_min(pergola_embed(var, inputs[0]), hf(inputs[0]))
        split = lat["pergola_graph_split_us"] = common.engine_split(engine, inputs, n)
        extra = "".join(f", {label} {lat[label]['p50']:.2f} ms" for label in variants)
        print(f"{name} batch-1 {length:5d} tok: graph p50 {lat['pergola_graph']['p50']:.2f} ms ("
              + ", ".join(f"{label} {us:.0f} µs" for label, us in split.items()) + "), eager "
              f"{lat['pergola_eager']['p50']:.2f} ms, HF {lat['hf']['p50']:.2f} ms{extra}, cos {check:.5f}",
              flush=True)
    for length in TPUT_LENGTHS[name]:
        batch = windows.ids(length, 100, seed=1000 + length)
        check = cosine_min(pergola_embed(engine, batch), hf(batch))
        # The engine and its variants take turns here too, one call each (HF, far slower, runs alone).
        engines = {"pergola": engine, **variants}
        timed = common.time_throughput_interleaved(
            {label: (lambda x, e=e: pergola_embed(e, x)) for label, e in engines.items()}, batch)
        p = timed["pergola"]
        h = time_throughput(hf, batch)
        limit = limit_tflops * 1e12 / flops_per_token(spec.hf_config, length, spec.causal)
        row = res["throughput"][length] = {"pergola": p, "hf": h, "min_cosine_vs_hf": check,
                                           "compute_limit_tokens_per_s": limit,
                                           "fraction_of_limit": p["tokens_per_s"] / limit,
                                           "ratio_vs_hf": p["tokens_per_s"] / h["tokens_per_s"]}
        for label, var in variants.items():
            row[label] = timed[label]
            row[label]["min_cosine_vs_hf"] = cosine_min(pergola_embed(var, batch), hf(batch))
        extra = "".join(f", {label} {row[label]['embeddings_per_s']:.0f}" for label in variants)
        print(f"{name} 100 x {length:5d} tok: pergola {p['embeddings_per_s']:.0f} emb/s "
              f"({p['tokens_per_s'] / 1e3:.0f}k tok/s, {p['tokens_per_s'] / limit:.0%} of limit), "
              f"HF {h['embeddings_per_s']:.0f} emb/s{extra}, cos {check:.5f}", flush=True)
    if args.profile and device == "cuda":
        for length in (128, 512):
            table = profile_step(engine, windows.ids(length, 1, seed=3))
            res[f"profile_batch1_{length}"] = table
            print(f"{name} profile, batch 1 x {length} tokens, 10 steps:\n{table}", flush=True)
    graphs = engine.runner.graphs
    res["graph_stats"] = {} if graphs is None else vars(graphs.stats) | {"keys": sorted(graphs.stats.keys)}
    res["attention_backends"] = time_attention_backends(spec.hf_config, spec.causal, args.backends)
    del engine, eager, hf, variants
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b", "minilm"], choices=sorted(LAT_LENGTHS))
    p.add_argument("--out", default="perf/out/engine.json")
    p.add_argument("--workdir", default=None, help="where generated model folders go")
    p.add_argument("--latency-n", type=int, default=100)
    p.add_argument("--variant", nargs="*", default=[], metavar="LABEL:FIELD=VALUE[,FIELD=VALUE]",
                   help="also time the engine with these EngineConfig overrides, e.g. "
                        "fa3:attention_backend=flashinfer_fa3 budget32k:max_batch_tokens=32768 fp8:quantization=fp8")
    p.add_argument("--profile", action="store_true", help="print the top kernels of batch-1 steps")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a dry run of the script")
    p.add_argument("--backends", nargs="+", default=["torch_flash", "sdpa", "flashinfer_fa2", "flashinfer_fa3"])
    args = p.parse_args()
    common.DEVICE = args.device
    if common.DEVICE != "cuda":  # dry run: one length per model
        for table in (LAT_LENGTHS, TPUT_LENGTHS):
            for k in table:
                table[k] = table[k][:1]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-bench-"))
    limit = matmul_tflops()
    gpu = torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu (dry run)"
    print(f"bf16 matmul: {limit:.0f} TFLOP/s on {gpu}", flush=True)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(sys.argv), "matmul_tflops": limit,
        "models": [bench_model(m, workdir, args, limit) for m in args.models],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    for m in results["models"]:
        for row in m["attention_backends"]:
            cells = ", ".join(f"{k} {v['us']:.0f} us" if "us" in v else f"{k} n/a"
                              for k, v in row.items() if isinstance(v, dict))
            print(f"{m['model']} attention {row['num_seqs']}x{row['seq_len']}: {cells}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
