"""perf/bench_adapter.py's trace arithmetic (CPU): Triton's trace entries of one request are merged
by id, the encoder's marks join the trace whose execute() they fall in, and spans are medians of
the gaps between consecutive events."""

from __future__ import annotations

import json

from bench_adapter import attach_marks, in_window, pergola_split, read_traces, timeline


def trace_entries(trace_id: int, start: int, model: str = "bench_encoder", parent: int | None = None) -> list[dict]:
    """Triton's file writes a request's name and its timestamps as separate entries."""
    head = {"id": trace_id, "model_name": model, "model_version": 1}
    if parent is not None:
        head["parent_id"] = parent
    stamps = [("REQUEST_START", 0), ("QUEUE_START", 5), ("COMPUTE_START", 20), ("COMPUTE_END", 300),
              ("REQUEST_END", 310), ("INFER_RESPONSE_COMPLETE", 2_000)]
    return [head, {"id": trace_id, "timestamps": [{"name": n, "ns": start + us * 1000} for n, us in stamps]}]


def marks(start: int) -> dict:
    at = {"execute": 100, "decoded": 120, "validated": 150, "options": 160, "submitted": 200, "started": 400,
          "gathered": 420, "filled": 470, "planned": 480, "queued": 650, "launched": 700, "on_host": 1_750,
          "engine_done": 1_800, "built": 1_900, "sent": 2_100}
    return {k: start + us * 1000 for k, us in at.items()}


def test_marks_join_their_trace_and_spans_are_ordered(tmp_path):
    entries = trace_entries(1, 1_000_000_000) + trace_entries(2, 2_000_000_000)
    entries += trace_entries(3, 3_000_000_000, model="floor")
    (tmp_path / "trace.json").write_text(json.dumps(entries))
    traces = read_traces(tmp_path / "trace.json")
    assert sorted(t["model"] for t in traces) == ["bench_encoder", "bench_encoder", "floor"]
    encoder = [t for t in traces if t["model"] == "bench_encoder"]
    attach_marks(encoder, [marks(1_000_000_000), marks(2_000_000_000)])
    assert all(t["events"]["execute"] - t["events"]["COMPUTE_START"] == 80_000 for t in encoder)

    picked = in_window(traces, (0, 2_500_000_000), "bench_encoder", child=False)
    assert len(picked) == 2
    tl = timeline(picked)
    order = [row["event"] for row in tl["events"]]
    assert order.index("COMPUTE_START") < order.index("execute") < order.index("COMPUTE_END") < order.index("started")
    assert tl["answered"] == "INFER_RESPONSE_COMPLETE" and tl["server_us"] == 2_000
    split = pergola_split(picked)
    assert split["validate"] == 30 and split["engine (step + copy back)"] == 1_400 and split["send"] == 200
    assert split["engine: pack + launch"] == 300 and split["engine: device + copy back"] == 1_050
    phases = ["gather", "fill + copy", "plan", "replay / kernels", "copy back queued"]
    assert [split[f"engine: {p}"] for p in phases] == [20, 50, 10, 170, 50]  # together: pack + launch


def test_ensemble_steps_are_told_apart_from_direct_calls(tmp_path):
    entries = trace_entries(1, 1_000_000_000) + trace_entries(2, 2_000_000_000, parent=7)
    (tmp_path / "trace.json").write_text(json.dumps(entries))
    traces = read_traces(tmp_path / "trace.json")
    assert len(in_window(traces, (0, 3_000_000_000), "bench_encoder", child=True)) == 1
    assert len(in_window(traces, (0, 3_000_000_000), "bench_encoder", child=False)) == 1
