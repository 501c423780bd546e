"""Plots for perf/RESULTS.md from the JSON and logs a benchmark run wrote.

    python perf/plot_results.py perf/results/2026-12-02
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def server_log(path: Path) -> dict:
    """Figures printed by bench_server.py (used when a run was cut before writing its JSON)."""
    text = path.read_text()
    lat = {int(m[0]): (float(m[1]), float(m[2]), float(m[3])) for m in
           re.findall(r"latency\s+(\d+) tok: pergola p50 ([\d.]+) p99 ([\d.]+) ms, HF p50 ([\d.]+)", text)}
    tput = {int(m[0]): (float(m[1]), float(m[2])) for m in
            re.findall(r"throughput 100 x (\d+) tok, 4 procs: pergola (\d+) emb/s, HF (\d+) emb/s", text)}
    return {"latency": lat, "throughput": tput}


def main(folder: Path) -> None:
    engine = json.loads((folder / "engine_qwen3.json").read_text())["models"][0]
    conc = json.loads((folder / "server_qwen3_latency_concurrency.json").read_text())["concurrency"]
    server = server_log(folder / "server_qwen3_final.log")

    # 1. batch-1 latency, p50 with p99 whiskers
    lengths = sorted(int(k) for k in engine["latency"])
    series = {
        "pergola engine, CUDA graph": [engine["latency"][str(n)]["pergola_graph"] for n in lengths],
        "pergola engine, eager": [engine["latency"][str(n)]["pergola_eager"] for n in lengths],
        "HF transformers (in-process)": [engine["latency"][str(n)]["hf"] for n in lengths],
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    for i, (label, rows) in enumerate(series.items()):
        xs = [j + (i - 1.5) * width for j in range(len(lengths))]
        p50 = [r["p50"] for r in rows]
        p99 = [r["p99"] - r["p50"] for r in rows]
        ax.bar(xs, p50, width, yerr=[[0] * len(rows), p99], label=label, capsize=3)
    xs = [j + 1.5 * width for j in range(len(lengths))]
    ax.bar(xs, [server["latency"][n][0] for n in lengths], width,
           yerr=[[0] * len(lengths), [server["latency"][n][1] - server["latency"][n][0] for n in lengths]],
           label="pergola through Triton (gRPC)", capsize=3)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_ylabel("ms (bar p50, whisker p99)")
    ax.set_yscale("log")
    ax.set_title("Qwen3-Embedding-0.6B shape, batch 1, sequential, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "latency_batch1.png", dpi=120)

    # 2. throughput vs length
    tl = sorted(int(k) for k in engine["throughput"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = engine["throughput"]
    ax.plot(tl, [rows[str(n)]["pergola"]["embeddings_per_s"] for n in tl], "o-", label="pergola engine")
    ax.plot(tl, [rows[str(n)]["pergola_eager_flashinfer_fa2"]["embeddings_per_s"] for n in tl], "o-",
            label="pergola engine, FlashInfer FA2 for big steps")
    ax.plot(tl, [server["throughput"][n][0] for n in tl], "s-", label="pergola through Triton, 4 client processes")
    ax.plot(tl, [rows[str(n)]["hf"]["embeddings_per_s"] for n in tl], "^-", label="HF transformers (in-process)")
    ax.plot(tl, [rows[str(n)]["compute_limit_tokens_per_s"] / n for n in tl], "k--", label="compute limit (measured matmul rate)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per text (100 texts per request)")
    ax.set_ylabel("embeddings / s")
    ax.set_title("Qwen3-Embedding-0.6B shape, throughput, H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=120)

    # 3. concurrency curve
    levels = sorted(int(k) for k in conc["pergola"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for q in ("p50", "p90", "p99"):
        ax.plot(levels, [conc["pergola"][str(c)][q] for c in levels], "o-", label=f"pergola {q}")
    ax.axhline(conc["hf_sequential"]["p50"], color="gray", ls="--", label="HF transformers p50, 1 at a time")
    ax2 = ax.twinx()
    ax2.plot(levels, [conc["pergola"][str(c)]["requests_per_s"] for c in levels], "k:", label="requests/s")
    ax2.set_ylabel("requests / s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (text, 512 tokens, batch 1, gRPC, tokenization included)")
    ax.set_ylabel("ms")
    ax.set_title("High-concurrency embedding through Triton, H200")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "concurrency.png", dpi=120)
    print(f"wrote {folder}/latency_batch1.png, throughput.png, concurrency.png")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "perf/results/2026-12-02"))
