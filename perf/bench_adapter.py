"""Where a batch-1 request's time goes between the gRPC client and the engine, and back.

    python perf/bench_adapter.py --model minilm --device cpu -n 300 --out perf/out/adapter_cpu.json
    python perf/bench_adapter.py --model qwen3-0.6b --device gpu -n 500 --out perf/out/adapter_gpu.json
    git worktree add /tmp/before HEAD~2 && python perf/bench_adapter.py --compare /tmp/before ...   # before/after

Starts pergola's tritonserver with Triton's own tracing on (--trace-config, mode triton,
TIMESTAMPS, every request) and the encoder's timing marks on (PERGOLA_ADAPTER_TIMING:
pergola/triton/adapter_timing.py), then sends sequential batch-1 requests with tritonclient gRPC to
  floor     a trivial Python model with the encoder's inputs that answers a zero vector at once
            from execute(): Triton's own floor on this host, measured in the same run
  floor_sender  the same, answered from a thread, through the request's response sender, after
            execute() returned (the encoder's way for requests that go through its loop)
  floor_gpu  on a GPU only: floor on a KIND_GPU instance, no batcher (the instance kind alone)
  floor_batcher  floor (answered from execute(), as the encoder answers a lone query while idle)
            behind the encoder's scheduling: Triton's dynamic batcher without a delay and an
            instance of the encoder's kind (KIND_GPU on a GPU), so that what the batcher and
            the instance kind cost on this host counts as Triton's, not as pergola's
  encoder   NAME_encoder, pre-tokenized INPUT_IDS (--length tokens, default 128)
  ensemble  the `embed` ensemble (tokenizer, then encoder) with a short text
and reports, per model, the p50 of the client's round trip and of every span between
consecutive events: Triton's (GRPC_*, REQUEST_START, QUEUE_START, COMPUTE_START,
COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END, REQUEST_END) merged with the encoder's
(execute, decoded, validated, options, submitted, started, engine_done, built, sent). Both use
CLOCK_MONOTONIC, so the events of one request line up on one time axis; events are listed in
the order of their median offset from REQUEST_START. The headline: `adapter_us`, the encoder's
server time (REQUEST_START -> INFER_RESPONSE_COMPLETE) less the engine's (started -> engine_done)
less a floor's server time, for each floor (also at the client: round trips less the engine).
With --compare CHECKOUT a second encoder and ensemble run another checkout's adapters and engine
package, requests taking turns with this checkout's: a before/after on a loaded host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ENGINE_PHASES, model_folder, percentiles, write_result  # noqa: E402
from inputs import TokenWindows  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.triton.adapter_timing import ENV as TIMING_ENV  # noqa: E402
from pergola.triton.repo_builder import build_repository, entry_from_folder  # noqa: E402
from pergola.triton.server import ServerOptions, local_ports, start, wait_ready  # noqa: E402

NAME, COMPARE = "bench", "compare"
FLOOR, FLOOR_SENDER, FLOOR_GPU, FLOOR_BATCHER = "floor", "floor_sender", "floor_gpu", "floor_batcher"
TEXT = "how do I sort a list of tuples by their second element in python?"
TRITON_EVENTS = ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
                 "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END", "GRPC_SEND_START",
                 "GRPC_SEND_END")

FLOOR_CONFIG = """name: "%s"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT_IDS" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "LENGTHS" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "DIM" value: { string_value: "%d" } }
parameters { key: "SENDER" value: { string_value: "%d" } }
instance_group [ { kind: %s count: 1 } ]
%s"""
# The encoder's batcher (ensemble_configs/encoder.pbtxt) without its queue policy, which is off by default.
BATCHER = "dynamic_batching { max_queue_delay_microseconds: 0 }\n"
FLOOR_MODEL = '''"""Triton's floor: read the inputs, answer a zero vector of the encoder's width, from
execute() (SENDER 0, as the encoder answers a lone query while idle), or as its loop does
(SENDER 1): a thread answers through the request's response sender after execute() returned."""
import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.zeros = np.zeros((1, int(params["DIM"]["string_value"])), dtype=np.float32)
        self.sender = params["SENDER"]["string_value"] == "1"
        self.queue = queue.SimpleQueue()
        if self.sender:
            threading.Thread(target=self._answer, daemon=True).start()

    def _answer(self):
        while True:
            sender = self.queue.get()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", self.zeros.copy())]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        out = []
        for request in requests:
            ids = np.array(pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy())
            if self.sender:
                self.queue.put(request.get_response_sender())
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", self.zeros)]))
        return None if self.sender else out
'''


def floor_models(gpu: bool) -> dict[str, tuple[int, str, str]]:
    """The floors run on this device: name -> (SENDER, instance kind, batcher block). On a GPU,
    `floor_gpu` (KIND_GPU, no batcher) sits between `floor` and `floor_batcher`, so that the
    instance kind's cost and the batcher's read apart."""
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    gpu_only = {FLOOR_GPU: (0, kind, "")} if gpu else {}
    return {FLOOR: (0, "KIND_CPU", ""), FLOOR_SENDER: (1, "KIND_CPU", ""), **gpu_only, FLOOR_BATCHER: (0, kind, BATCHER)}


def write_floor_models(repo: Path, dim: int, floors: dict[str, tuple[int, str, str]]) -> None:
    for name, (sender, kind, batcher) in floors.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(FLOOR_CONFIG % (name, dim, sender, kind, batcher))
        (repo / name / "1" / "model.py").write_text(FLOOR_MODEL)


def trace_flags(path: Path) -> list[str]:
    """Triton's own tracer, every request, timestamps only, written to `path` at shutdown."""
    return ["--trace-config=mode=triton", f"--trace-config=triton,file={path}",
            "--trace-config=triton,log-frequency=0", "--trace-config=level=TIMESTAMPS",
            "--trace-config=rate=1", "--trace-config=count=-1"]


# --- the client ---------------------------------------------------------------------------------
def run_phase(client, mod, targets: dict[str, tuple], n: int, warmup: int) -> dict:
    """`warmup` then `n` sequential requests to each target, label -> (model, make_inputs, outputs
    asked for or None for every one), taking turns so that all see the same load; -> per label its
    client round trips and the measured window on CLOCK_MONOTONIC (ns)."""
    calls = {label: (model, make, [mod.InferRequestedOutput(o) for o in outputs] if outputs else None)
             for label, (model, make, outputs) in targets.items()}
    for _ in range(warmup):
        for model, make, wanted in calls.values():
            client.infer(model, make(), outputs=wanted)
    ms: dict[str, list[float]] = {label: [] for label in calls}
    start_ns = time.monotonic_ns()
    for _ in range(n):
        for label, (model, make, wanted) in calls.items():
            inputs = make()
            t0 = time.perf_counter()
            client.infer(model, inputs, outputs=wanted)
            ms[label].append((time.perf_counter() - t0) * 1e3)
    window = (start_ns, time.monotonic_ns())
    return {label: {"window_ns": window, "client_ms": percentiles(ms[label])} for label in calls}


def token_inputs(mod, ids: np.ndarray):
    def make():
        a = mod.InferInput("INPUT_IDS", [1, ids.size], "INT64")
        a.set_data_from_numpy(ids[None, :])
        b = mod.InferInput("LENGTHS", [1, 1], "INT32")
        b.set_data_from_numpy(np.array([[ids.size]], dtype=np.int32))
        return [a, b]
    return make


def text_inputs(mod, text: str):
    def make():
        t = mod.InferInput("TEXT", [1], "BYTES")
        t.set_data_from_numpy(np.array([text.encode()], dtype=object))
        return [t]
    return make


# --- the analysis -------------------------------------------------------------------------------
def read_traces(path: Path) -> list[dict]:
    """Triton's trace file: entries of one request share an id; -> [{model, parent, events}]."""
    merged: dict[int, dict] = defaultdict(lambda: {"events": {}})
    for entry in json.loads(path.read_text()):
        trace = merged[entry["id"]]
        if "model_name" in entry:
            trace["model"] = entry["model_name"]
            trace["parent"] = entry.get("parent_id")
        for stamp in entry.get("timestamps", []):
            trace["events"][stamp["name"]] = stamp["ns"]
    return [t for t in merged.values() if "model" in t and "REQUEST_START" in t["events"]]


def read_marks(folder: Path, model: str) -> list[dict]:
    """An encoder's marks (pergola/triton/adapter_timing.py), every instance's file."""
    marks = []
    for path in folder.glob(f"{model}-*.json"):
        marks += [m for m in json.loads(path.read_text())["requests"] if "sent" in m]
    return sorted(marks, key=lambda m: m["execute"])


def attach_marks(traces: list[dict], marks: list[dict]) -> None:
    """Give each encoder trace the marks of the request it carried: the one whose execute()
    began between its COMPUTE_START and COMPUTE_END."""
    starts = np.array([m["execute"] for m in marks], dtype=np.int64)
    for trace in traces:
        ev = trace["events"]
        if "COMPUTE_START" not in ev or not starts.size:
            continue
        i = int(np.searchsorted(starts, ev["COMPUTE_START"]))
        if i < starts.size and starts[i] <= ev.get("COMPUTE_END", ev["REQUEST_END"]):
            ev.update({k: v for k, v in marks[i].items() if isinstance(v, int)})


def timeline(traces: list[dict]) -> dict:
    """Events in the order of their median offset from REQUEST_START, each with that offset and
    the p50 of the gap from the event before it (over the requests that have both), in µs."""
    if not traces:
        return {}
    offsets: dict[str, list[float]] = defaultdict(list)
    for t in traces:
        base = t["events"]["REQUEST_START"]
        for name, ns in t["events"].items():
            offsets[name].append((ns - base) / 1e3)
    answered = answered_event(traces)
    order = sorted(offsets, key=lambda name: np.median(offsets[name]))
    rows = []
    for prev, name in zip([None, *order], order):
        gaps = [(t["events"][name] - t["events"][prev]) / 1e3 for t in traces
                if prev is not None and name in t["events"] and prev in t["events"]]
        rows.append({"event": name, "offset_us": float(np.median(offsets[name])),
                     "gap_us": float(np.median(gaps)) if gaps else None, "n": len(offsets[name])})
    return {"events": rows, "answered": answered, "server_us": span(traces, "REQUEST_START", answered)}


def answered_event(traces: list[dict]) -> str:
    """The event at which a request's answer left the model. Not REQUEST_END: the encoder answers
    through its response sender after execute() returned, and Triton ends the request (REQUEST_END)
    when execute() returns. A top-level request's answer is INFER_RESPONSE_COMPLETE; an ensemble
    step's, the encoder's `sent` mark (its only witness)."""
    events = traces[0]["events"]
    return next(e for e in ("INFER_RESPONSE_COMPLETE", "sent", "REQUEST_END") if e in events)


def span(traces: list[dict], a: str, b: str) -> float | None:
    values = [(t["events"][b] - t["events"][a]) / 1e3 for t in traces if a in t["events"] and b in t["events"]]
    return float(np.median(values)) if values else None


def in_window(traces: list[dict], window: tuple[int, int], model: str, child: bool) -> list[dict]:
    lo, hi = window
    return [t for t in traces if t["model"] == model and (t["parent"] is not None) == child
            and lo <= t["events"]["REQUEST_START"] <= hi]


PERGOLA_SPANS = {  # what the adapter itself does, by pair of its marks
    "decode inputs": ("execute", "decoded"), "validate": ("decoded", "validated"),
    "options + job": ("validated", "options"), "submit": ("options", "submitted"),
    "loop wake-up": ("submitted", "started"), "engine (step + copy back)": ("started", "engine_done"),
    "metrics": ("engine_done", "metered"), "output tensors": ("metered", "outputs"),
    "response object": ("outputs", "built"), "send": ("built", "sent"),
    # ... and the engine's span for a query answered at once, as bench_engine.py splits it in process
    **{f"engine: {label}": ("started" if a == "start" else a, b) for label, (a, b) in ENGINE_PHASES.items()},
}


def pergola_split(traces: list[dict]) -> dict:
    return {label: span(traces, a, b) for label, (a, b) in PERGOLA_SPANS.items()}


def print_phase(label: str, res: dict) -> None:
    print(f"\n{label}: client round trip p50 {res['client_ms']['p50'] * 1e3:.0f} µs "
          f"(p90 {res['client_ms']['p90'] * 1e3:.0f}), server p50 {res.get('server_us') or 0:.0f} µs")
    for model, tl in res.get("models", {}).items():
        if not tl:
            continue
        print(f"  {model}: server (REQUEST_START -> {tl['answered']}) p50 {tl['server_us']:.0f} µs")
        print(f"    {'event':22s} {'at µs':>8s} {'+ µs (p50)':>11s}")
        for row in tl["events"]:
            gap = "" if row["gap_us"] is None else f"{row['gap_us']:11.1f}"
            print(f"    {row['event']:22s} {row['offset_us']:8.1f} {gap}")
    if res.get("pergola"):
        print("  pergola's own spans (p50 µs): " + ", ".join(
            f"{k} {v:.1f}" for k, v in res["pergola"].items() if v is not None))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", choices=["minilm", "qwen3-tiny", "qwen3-0.6b"])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("-n", type=int, default=300, help="measured requests per model")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--length", type=int, default=128, help="tokens of the encoder's pre-tokenized input")
    p.add_argument("--text", default=TEXT, help="the ensemble's input text")
    p.add_argument("--outputs", nargs="*", default=None, metavar="NAME",
                   help="also time the encoder asked for these outputs only (phase encoder_named), e.g. EMBEDDING; "
                        "the encoder phase names none, so it gets every one")
    p.add_argument("--compare", default=None, metavar="CHECKOUT",
                   help="another checkout of pergola (e.g. `git worktree add /tmp/before HEAD~1`): its tokenizer and "
                        "encoder adapters and engine package serve a second model, COMPARE, under this checkout's "
                        "configs; requests take turns between the two (labels NAME@compare), so both see the same load")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/adapter.json")
    args = p.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-adapter-"))
    workdir.mkdir(parents=True, exist_ok=True)
    folder = model_folder(args.model, workdir)
    spec = load_model_spec(folder)
    ids = TokenWindows(spec.tokenizer_file).ids(args.length, 1, seed=args.length)[0]
    names = [NAME, COMPARE] if args.compare else [NAME]
    repo = build_repository(workdir / "repo", [entry_from_folder(folder, name) for name in names],
                            gpu=args.device == "gpu")
    if args.compare:
        use_checkout(repo, COMPARE, Path(args.compare).resolve())
    floors = floor_models(gpu=args.device == "gpu")
    write_floor_models(repo, spec.hidden_size, floors)
    trace_file, marks_dir = workdir / "trace.json", workdir / "timing"
    for old in [trace_file, *marks_dir.glob("*.json")]:
        old.unlink(missing_ok=True)
    os.environ[TIMING_ENV] = str(marks_dir)  # the stubs inherit tritonserver's environment
    opts = ServerOptions(repo=repo, **local_ports(),
                         extra=trace_flags(trace_file))
    server = start(opts, log_path=workdir / "tritonserver.log")
    res: dict = {"model": args.model, "device": args.device, "length": args.length, "text": args.text,
                 "encoder_named_outputs": args.outputs, "compare": args.compare,
                 "n": args.n, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "command": " ".join(sys.argv), "commit": git_commit(Path(__file__).resolve().parent),
                 "compare_commit": git_commit(Path(args.compare)) if args.compare else None}
    # label -> (ensemble or None, encoder model, is the encoder an ensemble step)
    labels: dict[str, tuple[str | None, str, bool]] = {}
    try:
        wait_ready(opts.http_port, server, timeout=600)
        import tritonclient.grpc as mod

        client = mod.InferenceServerClient(f"127.0.0.1:{opts.grpc_port}")
        tokens, text = token_inputs(mod, ids), text_inputs(mod, args.text)
        suffixes = {name: "" if name == NAME else "@compare" for name in names}
        groups = [*({floor: (floor, tokens, None)} for floor in floors),
                  {f"encoder{suffixes[n]}": (f"{n}_encoder", tokens, None) for n in names}]
        if args.outputs:
            groups.append({f"encoder_named{suffixes[n]}": (f"{n}_encoder", tokens, args.outputs) for n in names})
        groups.append({f"ensemble{suffixes[n]}": ("embed" if n == NAME else n, text, None) for n in names})
        for n in names:
            labels |= {f"encoder{suffixes[n]}": (None, f"{n}_encoder", False),
                       f"encoder_named{suffixes[n]}": (None, f"{n}_encoder", False),
                       f"ensemble{suffixes[n]}": ("embed" if n == NAME else n, f"{n}_encoder", True)}
        phases = {label: out for group in groups for label, out in run_phase(client, mod, group, args.n,
                                                                             args.warmup).items()}
    finally:
        server.terminate()  # graceful: the encoder's finalize writes its marks, Triton its traces
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    traces = read_traces(trace_file)
    for name in names:
        model = f"{name}_encoder"
        attach_marks([t for t in traces if t["model"] == model], read_marks(marks_dir, model))
    for label, out in phases.items():
        window = out.pop("window_ns")
        if label in floors:
            models = [(label, False)]
        else:
            ensemble, encoder, step = labels[label]
            models = [(ensemble, False), (f"{ensemble_prefix(ensemble)}_tokenizer", True)] if ensemble else []
            models.append((encoder, step))
        out["models"] = {model: timeline(in_window(traces, window, model, child)) for model, child in models}
        out["server_us"] = out["models"][models[0][0]].get("server_us")
        if label not in floors:
            enc = in_window(traces, window, labels[label][1], labels[label][2])
            if enc:
                out["pergola"] = pergola_split(enc)
    res |= phases
    for label in phases:
        print_phase(label, res[label])
    res["adapter_us"] = {}
    for label in [label for label in phases if label.startswith("encoder")]:
        enc = phases[label]
        engine_us = (enc.get("pergola") or {}).get("engine (step + copy back)")
        for floor in floors:
            floor_us = phases[floor]["server_us"]
            if floor_us is None or engine_us is None or enc.get("server_us") is None:
                continue
            res["adapter_us"].setdefault(label, {})[floor] = added = {
                "server": enc["server_us"] - engine_us - floor_us,
                "client": (enc["client_ms"]["p50"] - phases[floor]["client_ms"]["p50"]) * 1e3 - engine_us}
            print(f"\n{label}: pergola's adapter beyond {floor} (p50): {added['server']:.0f} µs server-side "
                  f"(encoder server time - engine - floor server time), {added['client']:.0f} µs at the client")
    write_result(res, args.out)


def ensemble_prefix(ensemble: str) -> str:
    return NAME if ensemble == "embed" else ensemble


def use_checkout(repo: Path, name: str, checkout: Path) -> None:
    """Serve NAME's tokenizer and encoder with another checkout's adapters and engine package."""
    for part, adapter in (("tokenizer", "tokenizer"), ("encoder", "encoder")):
        version = repo / f"{name}_{part}" / "1"
        shutil.copyfile(checkout / "python_models" / adapter / "model.py", version / "model.py")
        (version / "pergola").unlink()
        (version / "pergola").symlink_to(checkout / "python_models" / "pergola", target_is_directory=True)


def git_commit(folder: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                              cwd=folder).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
