"""The plots of perf/README.md, drawn from the JSON files of one run (a perf/results folder).

    python perf/plot_results.py perf/results/2026-12-06-dee4f3a

Reads what the folder holds: engine_qwen3.json (bench_engine.py), server.json and scoring.json
(bench_server.py), bench_vllm.py's suites from vllm.json, or vllm_inproc.json and vllm_server.json,
anatomy.json (anatomy.py), mixed.json / mixed_one_lane.json (bench_mixed.py) and vLLM's mixed suite,
scaling.json (bench_scaling.py) and vLLM's vllm_dpN.json; writes latency_batch1.png, throughput.png,
concurrency.png, scoring.png, attention_kernels.png, anatomy.png, mixed_timeline.png, scaling.png and
ratios.png (pergola over the fastest vLLM per shape, from server*.json and vllm*_server.json) next to them. Each plot draws the systems the run measured and is skipped, with a note, where pergola
or vLLM is missing: every figure in a plot comes from the same run on the same machine.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

Json = dict[str, Any]
EMBED = "Qwen3-Embedding-0.6B shape"
RERANK = "Qwen3-Reranker-0.6B shape"
# one colour per system: dark = through a server, light = in-process
COLOR = {"pergola server": "#1f4e9c", "pergola engine": "#7fa7e0", "vLLM server": "#c2540a",
         "vLLM in-process": "#f5a35c", "HF": "#8c8c8c"}


def load(folder: Path, name: str) -> Json | None:
    path = folder / name
    if not path.exists():
        print(f"note: {path} missing")
        return None
    return json.loads(path.read_text())


def vllm_suites(folder: Path) -> Json:
    """bench_vllm.py's suites of this run by name (inproc, server, scoring_server, ...): vllm.json
    (every suite), else the files of the steps that ran one or two (vllm_inproc / vllm_server)."""
    suites: Json = {}
    for name in ("vllm.json", "vllm_inproc.json", "vllm_server.json"):
        if (folder / name).exists():
            for suite, data in json.loads((folder / name).read_text()).get("suites", {}).items():
                suites.setdefault(suite, data)
    return suites


def same_run(folder: Path) -> str:
    """"<GPU>, same run" for the titles: gpu.txt's first field, else a JSON's `gpu`."""
    if (folder / "gpu.txt").exists():
        return (folder / "gpu.txt").read_text().split(",")[0].strip().removeprefix("NVIDIA ") + ", same run"
    for path in sorted(folder.glob("*.json")):
        gpu = json.loads(path.read_text()).get("gpu") if path.stat().st_size < 10**7 else None
        if isinstance(gpu, str):
            return gpu.split(",")[0].removeprefix("NVIDIA ") + ", same run"
    return "same run"


def save(fig: Figure, folder: Path, name: str) -> None:
    fig.tight_layout()
    fig.savefig(folder / name, dpi=72)  # small PNGs: they live in git
    plt.close(fig)
    print(f"wrote {folder / name}")


def bars(ax: Axes, groups: list[int], series: dict[str, list[Json]], unit: str) -> None:
    """Grouped bars of p50 with p99 whiskers, p50 written above each bar; one group per x value."""
    width = 0.8 / len(series)
    for i, (label, rows) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        p50 = [r["p50"] for r in rows]
        err = [[0.0] * len(rows), [r["p99"] - r["p50"] for r in rows]]
        ax.bar(xs, p50, width, yerr=err, capsize=3, label=label, color=COLOR[label.split(" (")[0]],
               error_kw={"elinewidth": 1, "ecolor": "black"})
        for x, v, r in zip(xs, p50, rows):  # the p50 inside the bar, or above the whisker if the bar is short
            inside = v > 3 * ax.get_ylim()[0]
            ax.text(x, v * 0.93 if inside else r["p99"] * 1.08, f"{v:.3g}", ha="center",
                    va="top" if inside else "bottom", fontsize=7, rotation=90, color="white" if inside else "black")
    ax.set_xticks(range(len(groups)), [f"{g} {unit}" for g in groups])
    ax.set_yscale("log")
    ax.grid(axis="y", which="both", alpha=0.3)


def latency_figure(folder: Path, name: str, groups: list[int], series: dict[str, list[Json]], unit: str,
                   ylim: tuple[float, float], title: str) -> None:
    """One grouped-bar latency chart (p50 bars, p99 whiskers, log scale) written to `name`."""
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.set_ylim(*ylim)
    bars(ax, groups, series, unit)
    ax.set_ylabel("ms per request (bar p50, whisker p99)")
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8, loc="upper left")
    save(fig, folder, name)


def both(name: str, series: dict) -> bool:
    """Whether `series` holds pergola and vLLM (a plot of one of them alone is not drawn)."""
    if any(k.startswith("pergola") for k in series) and any(k.startswith("vLLM") for k in series):
        return True
    print(f"note: {name} needs pergola and vLLM from the same run; skipped")
    return False


def plot_latency(folder: Path, eng: Json | None, srv: Json | None, vl: Json) -> None:
    """Batch-1 latency per length: each system the run measured (servers, in process, HF)."""
    source = srv["latency"] if srv else eng["models"][0]["latency"] if eng else {}
    lengths = sorted(int(k) for k in source)
    columns = {  # label -> {length: {p50, p99, ...}}
        "pergola server (Triton, gRPC)": {n: srv["latency"][n]["pergola"] for n in srv["latency"]} if srv else None,
        "vLLM server (HTTP /v1/embeddings)": {n: r["vllm"] for n, r in vl["server"]["latency"].items()}
        if "server" in vl else None,
        "pergola engine (in-process, CUDA graph)": {n: r["pergola_graph"] for n, r in eng["models"][0]["latency"].items()}
        if eng else None,
        "vLLM in-process (llm.embed)": {n: r["vllm"] for n, r in vl["inproc"]["latency"].items()} if "inproc" in vl else None,
        "HF (transformers in-process)": {n: r["hf"] for n, r in source.items() if "hf" in r} or None,
    }
    series = {label: [col[str(n)] for n in lengths] for label, col in columns.items()
              if col and all(str(n) in col for n in lengths)}
    if both("latency_batch1.png", series):
        latency_figure(folder, "latency_batch1.png", lengths, series, "tokens", (1, 300),
                       f"{EMBED}: batch-1 latency, pre-tokenized, sequential ({same_run(folder)})")


def plot_throughput(folder: Path, eng: Json | None, srv: Json | None, vl: Json) -> None:
    """Embeddings/s per length, 100 texts a request: each system the run measured, and the compute limit."""
    e = eng["models"][0]["throughput"] if eng else None
    source = srv["throughput"] if srv else e or {}
    lengths = sorted(int(k) for k in source)
    columns = {  # label -> ({length: emb/s}, marker)
        "pergola server (Triton, 4 client procs)": ({n: r["pergola"]["embeddings_per_s"] for n, r in srv["throughput"].items()}
                                                    if srv else None, "s-"),
        "vLLM server (HTTP, 4 client procs)": ({n: r["vllm"]["embeddings_per_s"] for n, r in vl["server"]["throughput"].items()}
                                               if "server" in vl else None, "s-"),
        "pergola engine (in-process)": ({n: r["pergola"]["embeddings_per_s"] for n, r in e.items()} if e else None, "o--"),
        "vLLM in-process (llm.embed)": ({n: r["vllm"]["embeddings_per_s"] for n, r in vl["inproc"]["throughput"].items()}
                                        if "inproc" in vl else None, "o--"),
        "HF (transformers in-process)": ({n: r["hf"]["embeddings_per_s"] for n, r in source.items() if "hf" in r} or None, "^-"),
    }
    lines = {label: ([col[str(n)] for n in lengths], style) for label, (col, style) in columns.items()
             if col and all(str(n) in col for n in lengths)}
    if not both("throughput.png", lines):
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    if e:
        limit = [e[str(n)]["compute_limit_tokens_per_s"] / n for n in lengths]
        ax.plot(lengths, limit, "k--", lw=1, label="compute limit (measured matmul rate / length)")
    annotated = [next(k for k in lines if k.startswith(name)) for name in ("pergola", "vLLM")]  # servers first
    for label, (ys, style) in lines.items():
        ax.plot(lengths, ys, style, label=label, color=COLOR[label.split(" (")[0]], ms=6)
        if label in annotated:
            for n, y in zip(lengths, ys):
                ax.annotate(f"{y:.0f}", (n, y), textcoords="offset points", xytext=(6, 6 if "pergola" in label else -12),
                            fontsize=8, color=COLOR[label.split(" (")[0]])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("tokens per text (100 texts per request)")
    ax.set_ylabel("embeddings / s")
    ax.set_title(f"{EMBED}: throughput ({same_run(folder)})")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    save(fig, folder, "throughput.png")


def plot_concurrency(folder: Path, srv: Json | None, vl: Json) -> None:
    if not (srv and "server" in vl):
        print("note: concurrency.png needs server.json and vLLM's server suite; skipped")
        return
    runs = {"pergola server": srv["concurrency"]["pergola"], "vLLM server": vl["server"]["concurrency"]["vllm"]}
    length = srv["concurrency"]["length"]
    fig, (lat, rps) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, rows in runs.items():
        levels = sorted(int(k) for k in rows)
        c = COLOR[label]
        lat.plot(levels, [rows[str(n)]["p50"] for n in levels], "o-", color=c, label=f"{label} p50")
        lat.plot(levels, [rows[str(n)]["p99"] for n in levels], "o:", color=c, alpha=0.45, label=f"{label} p99")
        ys = [rows[str(n)]["requests_per_s"] for n in levels]
        rps.plot(levels, ys, "o-", color=c, label=label)
        for n, y in zip(levels, ys):
            rps.annotate(f"{y:.0f}", (n, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    for ax in (lat, rps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    lat.set_ylabel("ms per request")
    lat.set_title("latency")
    rps.set_ylabel("requests / s")
    rps.set_title("throughput")
    rps.set_ylim(0, None)
    fig.suptitle(f"{EMBED}: text requests, batch 1, {length} tokens, tokenization included ({same_run(folder)})",
                 fontsize=11)
    save(fig, folder, "concurrency.png")


def plot_scoring(folder: Path, sc: Json | None, vl: Json) -> None:
    if not (sc and "scoring_server" in vl and "scoring_inproc" in vl):
        print("note: scoring.png needs scoring.json and vLLM's scoring suites; skipped")
        return
    vs, vi = vl["scoring_server"]["scoring"], vl["scoring_inproc"]["scoring"]
    batches = sorted(int(k) for k in sc["scoring"])
    series = {
        "pergola server (Triton, gRPC)": [sc["scoring"][str(b)]["pergola"] for b in batches],
        "vLLM server (HTTP /classify)": [vs[str(b)]["vllm"] for b in batches],
        "vLLM in-process (llm.classify)": [vi[str(b)]["vllm"] for b in batches],
        "HF (transformers in-process)": [sc["scoring"][str(b)]["hf"] for b in batches],
    }
    latency_figure(folder, "scoring.png", batches, series, "pairs", (3, 400),
                   f"{RERANK}: scoring pairs of 512 tokens, pre-tokenized, sequential ({same_run(folder)})")


def plot_attention(folder: Path, eng: Json | None) -> None:
    if not eng:
        print("note: attention_kernels.png needs engine_qwen3.json; skipped")
        return
    m = eng["models"][0]
    backends = {"torch_flash": "#4c9a2a", "flashinfer_fa2": "#b07cc6", "flashinfer_fa3": "#6a2c91", "sdpa": "#bbbbbb"}
    micro = {f"{r['num_seqs']}x{r['seq_len']}": {b: r[b]["us"] for b in backends if "us" in r.get(b, {})}
             for r in m.get("attention_backends", [])}
    probe = m.get("attention", {}).get("probe_us") or {}
    probe_rows = {shape: {b: probe[b][shape] for b in probe} for shape in next(iter(probe.values()), {})}
    picked = m.get("attention", {}).get("eager", "?")
    panels = [("micro-benchmark: one attention call, eager, mean of 20", micro),
              (f"engine start-up probe (it picked {picked})", probe_rows)]
    panels = [(t, rows) for t, rows in panels if rows]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        shapes = list(rows)
        names = [b for b in backends if any(b in r for r in rows.values())]
        width = 0.8 / len(names)
        for i, b in enumerate(names):
            xs = [s + (i - (len(names) - 1) / 2) * width for s in range(len(shapes))]
            ax.bar(xs, [rows[s].get(b, 0) for s in shapes], width, label=b, color=backends[b])
        ax.set_xticks(range(len(shapes)), [s.replace("x", " x ") for s in shapes], fontsize=9)
        ax.set_xlabel("sequences x tokens")
        ax.set_yscale("log")
        ax.set_ylabel("µs per call")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{EMBED}: attention kernels, bf16, causal ({same_run(folder)})", fontsize=11)
    save(fig, folder, "attention_kernels.png")


ANATOMY_KINDS = {"matmul": "#1f4e9c", "attention": "#6a2c91", "norm": "#4c9a2a", "rope": "#8fc46a",
                 "act": "#c9b52c", "other": "#bbbbbb"}


def plot_anatomy(folder: Path, anatomy: Json | None) -> None:
    """Per engine call: kernel time by kind and the time the GPU waits, as shares of the wall time."""
    if not anatomy:
        print("note: anatomy.png needs anatomy.json (perf/anatomy.py); skipped")
        return
    shapes = anatomy["default"]["shapes"]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(shapes) + 2.0))
    for y, (shape, row) in enumerate(shapes.items()):
        wall, left = row["wall_us"], 0.0
        kinds = {k: 0.0 for k in ANATOMY_KINDS}
        for kind, us in row["kernels_us"].items():
            kinds[kind if kind in kinds else "other"] += us
        parts = list(kinds.items()) + [("GPU idle (host, gaps)", max(wall - sum(kinds.values()), 0.0))]
        for kind, us in parts:
            share = 100 * us / wall
            ax.barh(y, share, left=left, color=ANATOMY_KINDS.get(kind, "white"), edgecolor="#555555",
                    hatch="//" if kind not in ANATOMY_KINDS else None, label=kind if y == 0 else None)
            if share >= 6:
                ax.text(left + share / 2, y, f"{share:.0f}%", ha="center", va="center", fontsize=8,
                        color="white" if kind in ("matmul", "attention") else "black")
            left += share
        ax.text(101, y, f"{wall / 1000:.2f} ms" if wall < 1e5 else f"{wall / 1e6:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(shapes)), [s.replace("x", " texts x ") + " tok" for s in shapes], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 112)
    ax.set_xlabel("% of the wall time of one Engine.encode call (wall time at the right)")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.32))
    ax.set_title(f"{EMBED}: where an engine call spends its time ({same_run(folder).removesuffix(', same run')}, perf/anatomy.py)",
                 fontsize=10)
    save(fig, folder, "anatomy.png")


def vllm_mixed(folder: Path) -> Json | None:
    """bench_vllm.py --suites mixed's suite, in the shape of bench_mixed.py's JSON."""
    for name in ("vllm_mixed.json", "vllm.json"):
        if (folder / name).exists():
            suite = json.loads((folder / name).read_text()).get("suites", {}).get("mixed")
            if suite and "loads" in suite:
                return suite
    return None


def plot_mixed(folder: Path, runs: dict[str, Json | None]) -> None:
    """Query latency over time per bulk load, as bulk starts and stops (bench_mixed.py's timeline):
    one panel per load, one series per run (the query lane, one lane, vLLM)."""
    runs = {label: r for label, r in runs.items() if r is not None}
    if not runs:
        return
    loads = list(next(iter(runs.values()))["loads"])
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), sharey=True, squeeze=False)
    for ax, load_name in zip(axes[0], loads):
        for (label, run), color in zip(runs.items(), ("#1f4e9c", "#8c8c8c", "#c2540a")):
            row = run["loads"].get(load_name)
            if row is None:
                continue
            tl = row["timeline"]
            kind = tl["points"][0][2]  # the first query kind: the one timed before and after the bulk
            pts = [(t, ms) for t, ms, k in tl["points"] if k == kind]
            ax.plot([t for t, _ in pts], [ms for _, ms in pts], ".", ms=3, color=color, label=f"{label} ({kind})")
            ax.axvspan(tl["bulk_start"], tl["bulk_stop"], color=color, alpha=0.06)
        ax.set_yscale("log")
        ax.set_title(f"{load_name}: bulk from 4 processes (shaded)")
        ax.set_xlabel("seconds")
    axes[0][0].set_ylabel("query latency, ms (log)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Batch-1 query latency under bulk load, {EMBED}, {same_run(folder)}")
    save(fig, folder, "mixed_timeline.png")


def vllm_scaling(folder: Path, length: str) -> dict[int, float]:
    """vLLM's server emb/s at `length` by GPU count: vllm_dpN.json (gpu_session.sh vllm_scaling), and
    one GPU from this run's vllm.json or vllm_server.json when present."""
    files = [(folder / "vllm.json", 1), (folder / "vllm_server.json", 1)]
    files += [(path, int(path.stem.removeprefix("vllm_dp"))) for path in folder.glob("vllm_dp*.json")]
    points = {}
    for path, n in files:
        if path.exists():
            row = json.loads(path.read_text()).get("suites", {}).get("server", {}).get("throughput", {}).get(length)
            if row:
                points[n] = row["vllm"]["embeddings_per_s"]
    return points


def plot_scaling(folder: Path, sc: Json | None) -> None:
    """Embeddings/s against the number of GPUs (bench_scaling.py): one panel per length, a line per
    layout, N x one GPU dashed, vLLM's data-parallel server where measured."""
    if sc is None:
        return
    layouts = {name: lay["points"] for name, lay in sc["layouts"].items() if lay["points"]}
    lengths = sorted({length for pts in layouts.values() for p in pts.values() for length in p["lengths"]}, key=int)
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for (name, pts), color in zip(layouts.items(), ("#1f4e9c", "#7fa7e0")):
            ns = sorted(int(n) for n, p in pts.items() if length in p["lengths"])
            ax.plot(ns, [pts[str(n)]["lengths"][length]["embeddings_per_s"] for n in ns], "o-", color=color,
                    label=f"pergola, {name.replace('_', ' ')}")
            if 1 in ns:
                one = pts["1"]["lengths"][length]["embeddings_per_s"]
                ax.plot(ns, [n * one for n in ns], "--", color=color, alpha=0.4)
        vl = vllm_scaling(folder, length)
        if vl:
            ax.plot(sorted(vl), [vl[n] for n in sorted(vl)], "s-", color=COLOR["vLLM server"], label="vLLM server, DP")
        ax.set_title(f"100 x {length} tokens")
        ax.set_xlabel("GPUs")
        ax.set_xticks(sorted({int(n) for pts in layouts.values() for n in pts}))
    axes[0][0].set_ylabel("embeddings / s")
    axes[0][0].legend(fontsize=8, title="dashed: N x one GPU", title_fontsize=8)
    fig.suptitle(f"Throughput over N GPUs, {sc['model']} ({sc['device']})")
    save(fig, folder, "scaling.png")


# (shape, pergola's server JSON, bench_vllm's server suite of that shape, issue 39's goal over vLLM)
SHAPES = (("Qwen3-0.6B", "server.json", "server", 1.5), ("bge-m3", "server_bge_m3.json", "server_bge-m3", 1.2),
          ("ModernBERT", "server_gte_modernbert.json", "server_gte-modernbert", 1.2))


def vllm_versions(folder: Path) -> dict[str, Json]:
    """Each vLLM version's server suites in this run: vllm_server.json (0.22) and vllm025_server.json."""
    runs = {}
    for name in ("vllm_server.json", "vllm025_server.json"):
        if (folder / name).exists():
            data = json.loads((folder / name).read_text())
            runs[f"vLLM {data.get('vllm', name)}"] = data.get("suites", {})
    return runs


def ratio_rows(folder: Path) -> list[tuple[str, str, float, float, float | None]]:
    """(shape, length, pergola ÷ the fastest vLLM, the goal, pergola ÷ HF) per throughput length where
    pergola's server and a vLLM server ran the shape in this run."""
    rows = []
    versions = vllm_versions(folder)
    for shape, pergola_file, suite, goal in SHAPES:
        if not (folder / pergola_file).exists():
            continue
        ours = json.loads((folder / pergola_file).read_text()).get("throughput", {})
        for length, row in sorted(ours.items(), key=lambda kv: int(kv[0])):
            theirs = [v[suite]["throughput"][length]["vllm"]["embeddings_per_s"] for v in versions.values()
                      if length in v.get(suite, {}).get("throughput", {})]
            if theirs:
                hf = row["hf"]["embeddings_per_s"] if "hf" in row else None
                mine = row["pergola"]["embeddings_per_s"]
                rows.append((shape, length, mine / max(theirs), goal, mine / hf if hf else None))
    return rows


def plot_ratios(folder: Path) -> None:
    """pergola's server throughput over the fastest vLLM server's (and over HF in process) per shape and
    length, with each shape's goal: the figure the speed goals are read from."""
    rows = ratio_rows(folder)
    if not rows:
        print("note: ratios.png needs a pergola server JSON and vllm_server.json / vllm025_server.json; skipped")
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    vs_vllm = [r[2] for r in rows]
    ax.bar([x - 0.2 for x in xs], vs_vllm, 0.4, color=COLOR["vLLM server"], label="÷ the fastest vLLM server")
    ax.bar([x + 0.2 for x in xs], [r[4] or 0 for r in rows], 0.4, color=COLOR["HF"], label="÷ HF in process")
    for x, (_, _, ratio, goal, _) in zip(xs, rows):
        ax.hlines(goal, x - 0.45, x + 0.45, colors="black", linestyles="--", lw=1)
        ax.text(x - 0.2, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), [f"{shape}\n{length}" for shape, length, *_ in rows], fontsize=8)
    ax.set_ylabel("pergola ÷ baseline, emb/s (dashes: goal)")
    versions = " / ".join(vllm_versions(folder))
    ax.set_title(f"Throughput through the servers, 100 texts x 4 processes, against {versions} ({same_run(folder)})",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    save(fig, folder, "ratios.png")


def main(folder: Path) -> None:
    eng, srv, sc = (load(folder, n) for n in ("engine_qwen3.json", "server.json", "scoring.json"))
    vl = vllm_suites(folder)
    plots: list[Callable[[], None]] = [
        lambda: plot_latency(folder, eng, srv, vl),
        lambda: plot_throughput(folder, eng, srv, vl),
        lambda: plot_concurrency(folder, srv, vl),
        lambda: plot_scoring(folder, sc, vl),
        lambda: plot_attention(folder, eng),
        lambda: plot_anatomy(folder, load(folder, "anatomy.json")),
        lambda: plot_mixed(folder, {"pergola, query lane": load(folder, "mixed.json"),
                                    "pergola, one lane": load(folder, "mixed_one_lane.json"),
                                    "vLLM server": vllm_mixed(folder)}),
        lambda: plot_scaling(folder, load(folder, "scaling.json")),
        lambda: plot_ratios(folder),
    ]
    for plot in plots:
        plot()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) == 2 else 2)
    main(Path(sys.argv[1]))
