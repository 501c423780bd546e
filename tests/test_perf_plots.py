"""perf/plot_results.py's ratios: pergola's server over the fastest vLLM server of the same run, per shape
and length, from the JSON files bench_server.py and bench_vllm.py write (synthetic figures here)."""

from __future__ import annotations

import json
from pathlib import Path

import plot_results
import pytest


def write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def vllm_run(version: str, suites: dict[str, dict[str, float]]) -> dict:
    return {"vllm": version, "suites": {suite: {"throughput": {n: {"vllm": {"embeddings_per_s": v}}
                                                               for n, v in rates.items()}}
                                        for suite, rates in suites.items()}}


def test_ratios_take_the_fastest_vllm_per_length_and_skip_shapes_without_one(tmp_path):
    write(tmp_path, "server.json", {"throughput": {
        "512": {"pergola": {"embeddings_per_s": 1500.0}, "hf": {"embeddings_per_s": 300.0}},
        "4096": {"pergola": {"embeddings_per_s": 100.0}}}})
    write(tmp_path, "server_bge_m3.json", {"throughput": {"512": {"pergola": {"embeddings_per_s": 900.0}}}})
    write(tmp_path, "vllm_server.json", vllm_run("0.22.0", {"server": {"512": 1000.0, "4096": 80.0}}))
    write(tmp_path, "vllm025_server.json", vllm_run("0.25.0", {"server": {"512": 750.0, "4096": 90.0}}))
    rows = plot_results.ratio_rows(tmp_path)
    # bge-m3 has no vLLM figure in this run: no row, not a ratio against another run's
    assert [(shape, n) for shape, n, *_ in rows] == [("Qwen3-0.6B", "512"), ("Qwen3-0.6B", "4096")]
    (_, _, r512, goal, hf512), (_, _, r4096, _, hf4096) = rows
    assert r512 == pytest.approx(1.5) and r4096 == pytest.approx(100 / 90)  # 0.22 at 512, 0.25 at 4,096
    assert goal == 1.5 and hf512 == pytest.approx(5.0) and hf4096 is None
    plot_results.plot_ratios(tmp_path)
    assert (tmp_path / "ratios.png").stat().st_size > 0


def test_no_ratios_plot_without_vllm(tmp_path, capsys):
    write(tmp_path, "server.json", {"throughput": {"512": {"pergola": {"embeddings_per_s": 1500.0}}}})
    plot_results.plot_ratios(tmp_path)
    assert not (tmp_path / "ratios.png").exists()
    assert "skipped" in capsys.readouterr().out
