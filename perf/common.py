"""What the benchmarks share: the device they time on, the model folders they build, pergola's
embed call, the timers, the Hugging Face transformers baseline and the output check.

Imported with perf/ on sys.path (`sys.path.insert(0, <perf>)`, then `from common import ...`) by
the benchmarks beside it. A script that times on the CPU sets `common.DEVICE = "cpu"` first.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # pergola_testing: the seeded folders

from pergola.config.engine import EngineConfig  # noqa: E402
from pergola.engine import EncodeRequest, Engine  # noqa: E402
from pergola.outputs.pooling import finish  # noqa: E402

T = TypeVar("T")

DEVICE = "cuda"  # "cpu" gives a quick dry run of a benchmark on a laptop or CI box


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def cuda_time_us(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Mean µs of one eager call by CUDA events over `iters` calls after `warmup` ones (kernel
    benchmarks: bench_window, bench_attention)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


QWEN3_SHAPES = {"qwen3-0.6b": "qwen3-0.6b", "qwen3-tiny": "tiny",
                "qwen3-reranker-0.6b": "qwen3-0.6b", "qwen3-reranker-tiny": "tiny"}


@dataclass(frozen=True)
class ArchModel:
    """An encoder of another architecture as the benchmarks build it: a pergola_testing maker's
    seeded folder (seed 0, BF16 as the Qwen3 folders) in the model's published shape. Its CPU
    twin, NAME-tiny, is the same maker in the "tiny" shape with the maker's own limits."""

    maker: str  # a pergola_testing function taking (out, shape=, seed=, dtype=, max_seq_length=)
    shape: str  # the published shape's key in that module's shape table
    max_seq_length: int  # the published limit: the folder's, so pergola's max_seq_length and vLLM's max_model_len


# The architectures timed against vLLM besides Qwen3 and MiniLM, each declared once; both publish
# 8,192-token limits, so both run Qwen3's lengths.
ARCH_MODELS = {
    "bge-m3": ArchModel("make_bge_m3_folder", "bge-m3", 8192),  # BAAI/bge-m3: XLM-R large, CLS
    "gte-modernbert": ArchModel("make_modernbert_folder", "gte-modernbert-base", 8192),  # ModernBERT-base, CLS
}
TINY = "-tiny"


def arch_model(name: str) -> tuple[ArchModel, bool] | None:
    """("bge-m3-tiny") -> (ARCH_MODELS["bge-m3"], True): the declaration and whether it is the twin."""
    base = name.removesuffix(TINY)
    return (ARCH_MODELS[base], base != name) if base in ARCH_MODELS else None


def dry_twin(name: str) -> str:
    """The model a CPU dry run builds in place of `name`: an architecture's tiny twin, else itself."""
    return name + TINY if name in ARCH_MODELS else name


# Batch-1 latency lengths and throughput lengths (100 texts per call) per model, in tokens: the
# 8,192-token models all run Qwen3's, the tiny shapes one short length.
LONG_LAT, LONG_TPUT = [128, 512, 4096], [512, 1024, 4096]
LAT_LENGTHS = {"qwen3-0.6b": LONG_LAT, "minilm": [128, 256], "qwen3-tiny": [128]} \
    | {m: LONG_LAT for m in ARCH_MODELS} | {m + TINY: [128] for m in ARCH_MODELS}
TPUT_LENGTHS = {"qwen3-0.6b": LONG_TPUT, "minilm": [128, 256], "qwen3-tiny": [128]} \
    | {m: LONG_TPUT for m in ARCH_MODELS} | {m + TINY: [128] for m in ARCH_MODELS}
EMBED_MODELS = sorted(LAT_LENGTHS)  # every embedding model a benchmark can build


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": int(a.size)}


def arch_folder(name: str, out: Path) -> Path:
    """An ARCH_MODELS model's seeded folder (or its tiny twin's), built once into `out`."""
    import pergola_testing

    decl, tiny = arch_model(name)  # type: ignore[misc]
    if not (out / "model.safetensors").exists():
        limit = {} if tiny else {"max_seq_length": decl.max_seq_length}
        getattr(pergola_testing, decl.maker)(out, shape="tiny" if tiny else decl.shape, seed=0,
                                             dtype="bfloat16", **limit)
    return out


def model_folder(name: str, workdir: Path) -> Path:
    """The benchmark's model folder: MiniLM's real weights, a seeded Qwen3 in a published shape
    (`qwen3-reranker-0.6b`: Qwen3-Reranker-0.6B, a causal LM scored on its yes/no logits), or an
    ARCH_MODELS encoder's seeded folder (bge-m3, gte-modernbert, and their -tiny twins)."""
    if name == "minilm":
        from pergola.cli import default_model_folder

        return default_model_folder()
    if arch_model(name):
        return arch_folder(name, workdir / name)
    from pergola_testing import make_qwen3_folder, make_qwen3_reranker_folder

    out = workdir / name
    if not (out / "model.safetensors").exists():
        if name.startswith("qwen3-reranker"):
            make_qwen3_reranker_folder(out, shape=QWEN3_SHAPES[name], seed=0, dtype="bfloat16")
        else:
            make_qwen3_folder(out, shape=QWEN3_SHAPES[name], variant="causal-last", seed=0, dtype="bfloat16")
    return out


def parse_variants(specs: list[str]) -> dict[str, dict]:
    """["fa3:attention_backend=flashinfer_fa3,max_batch_tokens=32768"] -> {"fa3": {...}} (typed)."""
    types = {f.name: f.type for f in fields(EngineConfig)}
    out: dict[str, dict] = {}
    for spec in specs:
        label, _, body = spec.partition(":")
        overrides: dict = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in types:
                raise SystemExit(f"--variant {spec}: {key} is not an EngineConfig field")
            overrides[key] = int(value) if types[key] == "int" else \
                value.lower() in ("1", "true", "yes") if types[key] == "bool" else value
        out[label] = overrides
    return out


# --- pergola -----------------------------------------------------------------------------------
def pergola_embed(engine: Engine, seqs: list[np.ndarray]) -> np.ndarray:
    req = EncodeRequest(np.concatenate(seqs), np.array([len(s) for s in seqs], dtype=np.int32))
    return finish(engine.encode([req])[0], 0, engine.spec.normalize)


def profile_step(engine: Engine, seqs: list[np.ndarray], steps: int = 10) -> str:
    """Top kernels of `steps` calls (graph replays once warm): where the GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        pergola_embed(engine, seqs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            pergola_embed(engine, seqs)
        sync()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)


# --- timers ------------------------------------------------------------------------------------
def time_latency(call, inputs: list, n: int, warmup: int = 3) -> dict:
    for i in range(warmup):
        call(inputs[i % len(inputs)])
    ms = []
    for i in range(n):
        t0 = time.perf_counter()
        call(inputs[i % len(inputs)])
        ms.append((time.perf_counter() - t0) * 1e3)
    return percentiles(ms)


def time_latency_interleaved(calls: dict, inputs: list, n: int, warmup: int = 3) -> dict[str, dict]:
    """time_latency for several callables, one sample of each in turn: a drift during the run (GPU
    clocks, host load) then moves every column alike instead of favouring the first one measured
    (perf/results/2026-12-05-e2aaa64/NOTES.md: one configuration measured 1.27 and 1.44 ms apart)."""
    for call in calls.values():
        for i in range(warmup):
            call(inputs[i % len(inputs)])
    ms: dict[str, list[float]] = {label: [] for label in calls}
    for i in range(n):
        for label, call in calls.items():
            t0 = time.perf_counter()
            call(inputs[i % len(inputs)])
            ms[label].append((time.perf_counter() - t0) * 1e3)
    return {label: percentiles(v) for label, v in ms.items()}


# A batch-1 step's engine time by pair of Engine.last_step_marks ("start": when the call began): the
# host's work until the device has the step, then the wait for its result; and the host's work by phase.
# bench_engine.py reads them in process, bench_adapter.py inside Triton ("start" there: `started`).
ENGINE_PHASES = {
    "pack + launch": ("start", "launched"), "device + copy back": ("launched", "on_host"),
    "gather": ("start", "gathered"), "fill + copy": ("gathered", "filled"), "plan": ("filled", "planned"),
    "replay / kernels": ("planned", "queued"), "copy back queued": ("queued", "launched"),
}


def engine_split(engine: Engine, inputs: list, n: int) -> dict[str, float]:
    """p50 µs of each ENGINE_PHASES span over n batch-1 calls, in process."""
    spans: dict[str, list[float]] = {label: [] for label in ENGINE_PHASES}
    for i in range(n):
        t0 = time.monotonic_ns()
        pergola_embed(engine, inputs[i % len(inputs)])
        marks = {"start": t0, **engine.last_step_marks}
        for label, (a, b) in ENGINE_PHASES.items():
            spans[label].append((marks[b] - marks[a]) / 1e3)
    return {label: float(np.median(v)) for label, v in spans.items()}


def time_throughput(call, batch: list, min_seconds: float = 2.0, warmup: int = 2) -> dict:
    """`call(batch)` repeated for min_seconds (and 3 calls) -> embeddings/s, tokens/s, reps."""
    return time_throughput_interleaved({"": call}, batch, min_seconds, warmup)[""]


def time_throughput_interleaved(calls: dict, batch: list, min_seconds: float = 2.0, warmup: int = 2) -> dict:
    """time_throughput for several callables, one call of each in turn until each has run
    min_seconds (and 3 calls): an engine and its variants then share every drift of the GPU's
    clocks and the host's load, as in time_latency_interleaved."""
    for call in calls.values():
        for _ in range(warmup):
            call(batch)
    sync()
    seconds = dict.fromkeys(calls, 0.0)
    reps = dict.fromkeys(calls, 0)
    while min(seconds.values()) < min_seconds or min(reps.values()) < 3:
        for label, call in calls.items():
            t0 = time.perf_counter()
            call(batch)
            sync()
            seconds[label] += time.perf_counter() - t0
            reps[label] += 1
    tokens = sum(len(s) for s in batch)
    return {label: {"embeddings_per_s": len(batch) * reps[label] / seconds[label],
                    "tokens_per_s": tokens * reps[label] / seconds[label], "reps": reps[label]}
            for label in calls}


def drain(items: Iterable[T], threads: int, worker: Callable[[], Callable[[T], None]]) -> float:
    """Each of `items` handled once by `threads` threads, each with its own worker() (a client with
    its own connection) -> the wall seconds from the first start to the last finish."""
    source = iter(items)
    lock = threading.Lock()

    def run() -> None:
        handle = worker()
        while True:
            with lock:
                item = next(source, _END)
            if item is _END:
                return
            handle(item)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


_END = object()


# --- Hugging Face transformers baseline and the output check -----------------------------------
class HFBaseline:
    """AutoModel in BF16 with SDPA, padded batches of 32 (sentence-transformers' default)."""

    def __init__(self, folder: Path, pooling: str, normalize: bool, device: str | None = None) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoModel

        self.device = device or DEVICE
        self.model = AutoModel.from_pretrained(str(folder), dtype=torch.bfloat16, attn_implementation="sdpa")
        self.model = self.model.to(self.device).eval()
        self.pooling, self.normalize = pooling, normalize
        self.tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        """Tokenize (HF tokenizers, as sentence-transformers does) and embed."""
        return self([np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts)])

    @torch.inference_mode()
    def __call__(self, seqs: list[np.ndarray], batch_size: int = 32) -> np.ndarray:
        out = []
        for i in range(0, len(seqs), batch_size):
            chunk = seqs[i:i + batch_size]
            n = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), n, dtype=torch.long)
            mask = torch.zeros(len(chunk), n, dtype=torch.long)
            for j, s in enumerate(chunk):  # right padding; last-token pooling reads each length
                ids[j, :len(s)] = torch.from_numpy(s)
                mask[j, :len(s)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            if self.pooling == "last":
                emb = hidden[torch.arange(len(chunk)), mask.sum(1) - 1]
            elif self.pooling == "cls":
                emb = hidden[:, 0]
            else:
                emb = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            if self.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
            out.append(emb.cpu().numpy())
        return np.concatenate(out)


def cosine_min(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def encoder_start_lines(log_path: Path, max_chars: int = 4000) -> list[str]:
    """The encoder's start-up lines from tritonserver's log (python_models/encoder/model.py): its
    attention kernels by step size and the probe's timings, which each start measures anew. Kept
    with a run's figures so that a throughput that moves between runs can be put beside the kernels
    each start chose."""
    if not log_path.exists():
        return []
    keep = (": device ", ": attention probe")
    return [line[:max_chars] for line in log_path.read_text(errors="replace").splitlines()
            if any(k in line for k in keep)]


def write_result(res: dict, path: str | Path) -> None:
    """A benchmark's JSON (date, command and figures) where --out says."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out}")
