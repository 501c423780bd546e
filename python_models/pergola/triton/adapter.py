"""Helpers the Triton `model.py` adapters share: optional inputs, a request's options (embedding,
rerank or classify), errors, instance device, CPU threads.

`pb_utils` (triton_python_backend_utils) only exists inside the Triton stub, so the adapters
pass it in; everything else in pergola imports and tests without Triton.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, NamedTuple

import numpy as np

from pergola.outputs.token_outputs import DEFAULT_OUTPUTS, check_outputs
from pergola.text.classify import ClassifyOptions
from pergola.text.encodings import check_encoding
from pergola.text.errors import RequestError, bounded, decode_utf8
from pergola.text.rerank import RerankOptions
from pergola.text.tokenization import truncate_mode

MAX_OPTION_BYTES = 256  # string options are short names (PROMPT_NAME, ENCODING)
# A request parameter the gateway sets on work it admitted, having weighed it against all the work
# it had accepted before doing any of it (gateway/admission.py); it sends a request's chunks a few
# at a time. The encoder's queue bound would count a request's own chunks as work ahead of it: it
# refused the later chunks of a 1,024-text request on an idle server, at every retry. Such work
# is bounded by its deadline there (engine/loop.py `_admit`), not by max_queue_seconds.
ADMITTED = "pergola_admitted"
MAX_OPTION_NAMES = 8  # a list option (OUTPUTS) holds a few names


def optional_single(pb_utils: Any, request: Any, name: str) -> Any | None:
    """The one element of an optional input as it came (bytes for BYTES), or None when not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"{name} takes exactly one value, got {values.size}")
    return values[0]


def optional_scalar(pb_utils: Any, request: Any, name: str) -> Any | None:
    """First element of an optional input, or None when the client did not send it."""
    value = optional_single(pb_utils, request, name)
    if value is None:
        return None
    if isinstance(value, bytes):
        if len(value) > MAX_OPTION_BYTES:
            raise RequestError(f"{name} is {len(value):,} bytes; it takes a short name (at most {MAX_OPTION_BYTES})")
        return decode_utf8([value], name)[0]
    return value.item() if isinstance(value, np.generic) else value


def optional_names(pb_utils: Any, request: Any, name: str) -> list[str] | None:
    """An optional list of short names (OUTPUTS: BYTES [k] or [1, k]), decoded; None when not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1).tolist()
    if len(values) > MAX_OPTION_NAMES or any(len(v) > MAX_OPTION_BYTES for v in values):
        raise RequestError(f"{name} takes at most {MAX_OPTION_NAMES} short names")
    return decode_utf8(values, name)


def required_strings(pb_utils: Any, request: Any, name: str) -> list[bytes]:
    """A 1-D BYTES input ([n] strings) as a list of bytes, refused if missing or of another shape."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise RequestError(f"input {name} is required")
    raw = tensor.as_numpy()
    if raw.ndim != 1:
        raise RequestError(f"{name} must be 1-D ([n] strings), got shape {list(raw.shape)}")
    return raw.tolist()


class EmbedOptions(NamedTuple):
    """What an embedding request asks of its answer."""

    dimensions: int  # leading dimensions kept, 0: all
    normalize: bool
    encoding: str  # pergola.text.encodings
    outputs: tuple[str, ...] = DEFAULT_OUTPUTS  # dense, sparse, colbert (pergola.outputs.token_outputs)
    spans: Any = None  # late chunking's pergola.text.chunking.SpanPlan (CHUNK_SPANS): one row per chunk


class TokenizerAdapter:
    """What the tokenizer adapters (TritonPythonModel) share: their config, heap trimming, metrics,
    and one response per request (`_execute_one`, each adapter's own, reading the request's inputs
    from a RequestInputs: a text request looks up nine names)."""

    def _setup(self, pb_utils: Any, args: dict[str, str]) -> Any:
        """-> the model's EngineConfig (from config.pbtxt)."""
        from pergola.config.engine import EngineConfig
        from pergola.memory import HeapTrimmer
        from pergola.triton.metrics import TokenizerMetrics

        end_with_server()
        self.cfg = EngineConfig.from_triton_args(args)
        self.trimmer = HeapTrimmer()  # a large request's buffers go back to the system (pergola/memory.py)
        self.metrics = TokenizerMetrics(pb_utils, args["model_name"], flush_s=self.cfg.metrics_flush_s)
        return self.cfg

    def _execute_one(self, request: Any, inputs: RequestInputs) -> Any:
        raise NotImplementedError

    def _respond(self, pb_utils: Any, enc: Any, started: float, outputs: dict[str, np.ndarray]) -> Any:
        """An encoded request's response: INPUT_IDS and LENGTHS [1, ...], then `outputs`, then
        TOKEN_COUNT and TRUNCATED [n]; the tokenizing time since `started` goes to the metrics."""
        self.metrics.observe(time.perf_counter() - started)
        tensors = {"INPUT_IDS": enc.input_ids[None, :], "LENGTHS": enc.lengths[None, :], **outputs,
                   "TOKEN_COUNT": enc.lengths, "TRUNCATED": enc.truncated}
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in tensors.items()])

    def execute(self, requests: list) -> list:
        return [self._execute_one(r, RequestInputs(r)) for r in requests]

    def finalize(self) -> None:
        self.metrics.close()


def read_truncation(pb_utils: Any, request: Any, default: bool) -> str:
    """TRUNCATE_MODE (NONE | START | END) or its BOOL form TRUNCATE (true = END, false = NONE);
    with both, they must agree; with neither, the model's default (`--truncate`)."""
    flag = optional_scalar(pb_utils, request, "TRUNCATE")
    mode = optional_scalar(pb_utils, request, "TRUNCATE_MODE")
    if mode is None:
        return truncate_mode(None if flag is None else bool(flag), default)
    mode = truncate_mode(mode)
    if flag is not None and bool(flag) != (mode != "NONE"):
        raise RequestError(f"TRUNCATE={str(bool(flag)).lower()} contradicts TRUNCATE_MODE={mode}; send one of them")
    return mode


def optional_count(pb_utils: Any, request: Any, name: str) -> int | None:
    """An optional INT32 count such as MAX_TOKENS (None when not sent)."""
    value = optional_scalar(pb_utils, request, name)
    return None if value is None else int(value)


def rerank_options(pb_utils: Any, request: Any) -> RerankOptions:
    """A rerank request's TOP_N (0 or omitted: every document), checked, and RAW_SCORES."""
    return RerankOptions(int(optional_scalar(pb_utils, request, "TOP_N") or 0),
                         bool(optional_scalar(pb_utils, request, "RAW_SCORES") or False))


def classify_options(pb_utils: Any, request: Any) -> ClassifyOptions:
    """A classify request's RAW_SCORES (logits instead of probabilities)."""
    return ClassifyOptions(bool(optional_scalar(pb_utils, request, "RAW_SCORES") or False))


def embed_options(pb_utils: Any, request: Any, hidden: int, default_normalize: bool,
                  offered: tuple[str, ...] = DEFAULT_OUTPUTS) -> EmbedOptions:
    """An embedding request's DIMENSIONS (0 = all), NORMALIZE, ENCODING and OUTPUTS (of those the
    model `offered`), checked and defaulted."""
    dims = int(optional_scalar(pb_utils, request, "DIMENSIONS") or 0)
    if dims and not 1 <= dims <= hidden:
        raise RequestError(f"DIMENSIONS={dims} is out of range; this model gives 1..{hidden} dimensions "
                           "(0 or omitted = all)")
    normalize = optional_scalar(pb_utils, request, "NORMALIZE")
    normalize = default_normalize if normalize is None else bool(normalize)
    return EmbedOptions(dims, normalize, check_encoding(optional_scalar(pb_utils, request, "ENCODING"), normalize),
                        check_outputs(optional_names(pb_utils, request, "OUTPUTS"), offered))


class RequestInputs:
    """One request's input tensors by name, listed once. It stands in for pb_utils in the helpers
    here, which only call `get_input_tensor_by_name`: pb_utils' own lists every input of the
    request again (a new Python object per tensor) for each name it looks up, and an encoder
    request looks up eight names (the hot path of a batch-1 request: perf/bench_adapter.py)."""

    __slots__ = ("tensors",)

    def __init__(self, request: Any) -> None:
        self.tensors = {tensor.name(): tensor for tensor in request.inputs()}

    def get_input_tensor_by_name(self, _request: Any, name: str) -> Any | None:
        return self.tensors.get(name)


def required_array(pb_utils: Any, request: Any, name: str, dtype: type) -> np.ndarray:
    """A numeric input flattened, as an owned copy (the request's memory is freed after execute)."""
    array = optional_array(pb_utils, request, name, dtype)
    if array is None:
        raise RequestError(f"input {name} is required")
    return array


def optional_array(pb_utils: Any, request: Any, name: str, dtype: type) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else np.array(tensor.as_numpy().reshape(-1), dtype=dtype)


def admitted(request: Any) -> bool:
    """Whether the gateway admitted `request` (its ADMITTED parameter)."""
    return bool(json.loads(request.parameters() or "{}").get(ADMITTED))


def inference_error(pb_utils: Any, exc: Exception) -> Any:
    """A Triton error response; RequestError is the client's to fix (INVALID_ARG)."""
    if isinstance(exc, RequestError):
        return pb_utils.InferenceResponse(
            error=pb_utils.TritonError(bounded(str(exc)), pb_utils.TritonError.INVALID_ARG)
        )
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(
        bounded(f"internal error: {type(exc).__name__}: {exc}"), pb_utils.TritonError.INTERNAL))


def set_cpu_threads(cfg: Any) -> int | None:
    """Set torch's intra-op threads for a CPU instance (EngineConfig.cpu_threads; 0 = the cores
    this process may use, less one for Triton's server threads, at least 1); None on a GPU.

    Only in the stub process the adapter owns: an in-process Engine (tests, benchmarks) keeps
    its caller's setting.
    """
    if not str(cfg.device).startswith("cpu"):
        return None
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cfg.cpu_threads or max(1, cores - 1)
    torch.set_num_threads(threads)
    return threads


def instance_device(args: dict[str, str]) -> str:
    """'cuda:N' for a KIND_GPU instance, 'cpu' otherwise."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{args['model_instance_device_id']}"
    return "cpu"


# Messages of errors after which a process's CUDA context is unusable: every later kernel fails.
FATAL_DEVICE_ERRORS = ("device-side assert", "illegal memory access", "unspecified launch failure",
                       "misaligned address", "illegal instruction", "CUDA error: an illegal")


def is_fatal_device_error(exc: BaseException) -> bool:
    """True for a CUDA fault that poisons the process (not e.g. an out-of-memory error)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in FATAL_DEVICE_ERRORS)


def exit_soon(pb_utils: Any, model: str, exc: BaseException, delay_s: float = 1.0) -> None:
    """After a fatal device error: answer the failed batch, then end this stub process.

    A poisoned CUDA context cannot serve again, and Triton keeps routing requests to a living
    stub; ending it lets the `pergola serve` supervisor reload the model (supervisor.py). The
    delay leaves time for this batch's error responses to go out.
    """
    import os
    import threading

    pb_utils.Logger.log_error(f"{model}: fatal device error ({exc}); exiting so the model is reloaded")
    threading.Timer(delay_s, os._exit, args=(70,)).start()


# A shell that ends the stub (SIGKILL) once tritonserver ($1) has gone, and ends itself when the
# stub ($2) has ended on its own (then it kills nothing). kill -0 only asks whether a process exists.
_WATCHDOG = ('while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 2; done; '
             'kill -0 "$1" 2>/dev/null || { kill -0 "$2" 2>/dev/null && kill -9 "$2"; }')
_watchdogs: list[Any] = []  # (held: a dropped Popen of a running process warns)


def end_with_server(every_s: float = 1.0) -> None:
    """End this stub process when tritonserver, its parent, has gone.

    Triton 2.51's stub watches its parent as well, but its way out first locks the queue to the
    server, and a stub that was inside a call to the server at that moment (a metric update, a
    response) waits on that lock for good: the encoder stub of a server killed under traffic
    was still alive minutes later, with its memory (a GPU's included: what the restarted server
    needs), in each of three runs of tests/test_gateway.py's two-replica test. A parent that
    has gone and been reaped leaves this process to another parent, so os.getppid() changes;
    a thread that sees it calls os._exit, which skips every lock and finalizer.

    That thread needs the GIL, and python_backend's metric calls (Metric.set in every version
    read, increment in some) wait for the server's reply while holding it: a stub caught there
    runs no Python again, the likely reason stubs of a killed server were left alive
    (perf/results/2026-12-05-05e666b/NOTES.md). So a small shell process beside each stub, which
    needs nothing from it, kills it too (tests/test_hardening.py holds a stub's GIL for good)."""
    import subprocess
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="pergola-parent-watch", daemon=True).start()
    _watchdogs.append(subprocess.Popen(["sh", "-c", _WATCHDOG, "pergola-stub-watchdog", str(parent), str(os.getpid())],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True))
