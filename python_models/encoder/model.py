"""Triton adapter for <name>_encoder: ragged token ids -> embeddings [n, dim] in the ENCODING
asked for (pergola.text.encodings: EMBEDDING FP32 by default), or for a reranker, SCORE [n] (input
order) and INDICES (best first, TOP_N of them when given): sigmoid(logit), or the logit itself
with RAW_SCORES (pergola.outputs.heads: the activation is applied here, on the model's logits); for a
classifier, PROBS [n, labels] (softmax or sigmoid; logits with RAW_SCORES) and LABELS [labels].
With CHUNK_SPANS (late chunking, pergola.text.chunking) an embedder's rows are one per chunk: the mean
of its tokens' last hidden states, summed on the device per step.

`execute()` checks and queues each request and returns at once; the engine's loop thread
(pergola/engine/loop.py) packs the sequences of every queued request into steps and answers
each request through its response sender when its last sequence is done (a non-decoupled
model may answer this way since Triton 24.06). Requests whose client went away are dropped
between steps; new work is refused at once (UNAVAILABLE) when the queue is full of work.
"""

import faulthandler
import threading
import time
from functools import partial

import numpy as np
import triton_python_backend_utils as pb_utils
from pergola.config.engine import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.engine.loop import Cancelled, EncodeLoop, Job, Overloaded, Unloading
from pergola.outputs.heads import activate, activation, label_names
from pergola.outputs.pooling import finish
from pergola.outputs.token_outputs import DEFAULT_OUTPUTS, TOKEN_TENSORS, row_width, skipped_token_ids, token_outputs
from pergola.text.classify import ClassifyOptions
from pergola.text.encodings import EMBEDDING_TENSORS, encoded_outputs
from pergola.text.errors import RequestError
from pergola.text.rerank import RerankOptions, rank
from pergola.triton.adapter import (
    EmbedOptions,
    RequestInputs,
    admitted,
    classify_options,
    embed_options,
    end_with_server,
    exit_soon,
    inference_error,
    instance_device,
    is_fatal_device_error,
    optional_array,
    required_array,
    rerank_options,
    set_cpu_threads,
)
from pergola.triton.adapter_timing import AdapterTiming
from pergola.triton.metrics import EncoderMetrics, info_labels

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        # A crash in native code (a kernel library, the stub's IPC) then leaves every thread's Python
        # stack in Triton's log instead of the stub's bare "Segfault encountered".
        faulthandler.enable(all_threads=True)
        end_with_server()  # not left behind, holding the GPU, when tritonserver dies
        self.model_name = args["model_name"]
        self.cfg = EngineConfig.from_triton_args(args, device=instance_device(args))
        threads = set_cpu_threads(self.cfg)
        self.engine = Engine(self.cfg)
        self.hidden = self.engine.spec.hidden_size
        self.rerank = self.engine.spec.task == "rerank"
        self.classify = self.engine.spec.task == "classify"
        self.activation = activation(self.engine.spec)
        self.labels = np.array([name.encode("utf-8") for name in label_names(self.engine.spec)], dtype=object)
        self.skipped_ids = skipped_token_ids(self.engine.spec)  # left out of bge-m3's sparse output
        runner = self.engine.runner
        attention = runner.attention_in_use()
        pb_utils.Logger.log_info(f"{args['model_name']}: device {self.cfg.device}, attention {attention}, "
                                 f"CUDA graphs {'on' if runner.graphs is not None else 'off'}"
                                 f"{'' if threads is None else f', {threads} CPU threads'}; "
                                 f"start-up: {runner.startup_line()}")
        if runner.probe is not None and len(runner.probe.micros) > 1:
            pb_utils.Logger.log_info(f"{args['model_name']}: attention probe, µs per layer call: "
                                     f"{runner.probe.micros}")
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], attention, flush_s=self.cfg.metrics_flush_s,
                                      info=info_labels(self.cfg))
        self.timing = AdapterTiming.from_env(self.model_name)  # None unless PERGOLA_ADAPTER_TIMING is set
        # The metrics are touched by the loop's thread (after its steps, when idle) and by
        # execute()'s (queries answered at once).
        self.metrics_lock = threading.Lock()
        self.loop = EncodeLoop(self.engine, self.cfg.max_queue_seconds, on_step=self._on_step,
                               on_idle=self._on_idle, on_fatal=self._fatal)
        # Again, last: FlashInfer loads tvm-ffi while the Engine is built, whose library installs
        # its own SIGSEGV handler over faulthandler's (and prints no Python stack); enable() alone
        # does nothing while faulthandler believes it is on.
        faulthandler.disable()
        faulthandler.enable(all_threads=True)

    def _on_idle(self) -> None:
        with self.metrics_lock:
            self.metrics.flush(self.engine.stats)

    def _on_step(self) -> None:
        t0 = time.monotonic_ns()
        with self.metrics_lock:
            self.metrics.update(self.engine.stats, self.loop)
        if self.timing is not None:
            self.timing.metrics_ns.append(time.monotonic_ns() - t0)

    def _decode(self, request, marks: dict | None = None) -> tuple[EncodeRequest, EmbedOptions | RerankOptions | ClassifyOptions]:
        """-> (request, how to answer it). The arrays are copies: a request's tensors are freed
        when execute() returns, before the loop computes it. `marks`: pergola.triton.adapter_timing."""
        inputs = RequestInputs(request)  # listed once, for the lookups below (in pb_utils' place)
        req = EncodeRequest(
            input_ids=required_array(inputs, request, "INPUT_IDS", np.int64),
            lengths=required_array(inputs, request, "LENGTHS", np.int32),
            prompt_lengths=optional_array(inputs, request, "PROMPT_LENGTHS", np.int32),
            token_types=optional_array(inputs, request, "TOKEN_TYPE_IDS", np.int64),
        )
        if marks is not None:
            marks["decoded"] = time.monotonic_ns()
        self.engine.validate(req)
        if marks is not None:
            marks["validated"] = time.monotonic_ns()
        if self.rerank:
            return req, rerank_options(inputs, request)
        if self.classify:
            return req, classify_options(inputs, request)
        options = embed_options(inputs, request, self.hidden, self.engine.spec.normalize, self.engine.spec.outputs)
        spans = optional_array(inputs, request, "CHUNK_SPANS", np.int64)
        if spans is not None:  # late chunking: one row per chunk, pooled over its spans (pergola.text.chunking)
            if options.outputs != DEFAULT_OUTPUTS:
                raise RequestError("CHUNK_SPANS (late chunking) gives dense vectors only; leave out OUTPUTS")
            options = options._replace(spans=self.engine.late_request(req, spans))
        width = row_width(options.outputs, self.engine.runner.token_width)
        if width:  # bge-m3's per-token outputs: the loop fills these rows
            req.token_rows = np.empty((req.input_ids.size, width), dtype=np.float32)
        return req, options

    def execute(self, requests: list) -> list | None:
        now = time.monotonic()
        timing = self.timing
        for request in requests:
            marks = None if timing is None else timing.begin()
            decoded = None
            if len(requests) == 1:  # a lone request: a query is answered at once when the loop is idle
                try:
                    decoded = self._decode(request, marks)
                    answer = self._at_once(request, *decoded, marks)
                except Exception as e:  # noqa: BLE001 - a bad request fails alone
                    return [self._error_response(e)]
                if answer is not None:
                    return [answer]
            sender = request.get_response_sender()
            try:
                req, options = decoded or self._decode(request, marks)
                timeout_us = request.timeout()  # Triton's per-request `timeout` parameter (0: none)
                wanted = request.requested_output_names()  # all of them when the caller named none
                job = Job(req, deliver=partial(self._deliver, sender, options, marks, req, wanted),
                          fail=partial(self._fail, sender), cancelled=sender.is_cancelled,
                          deadline=now + timeout_us / 1e6 if timeout_us else None,
                          checked_at=now,  # not gone yet: asking (an IPC) can wait CANCEL_CHECK_S
                          admitted=admitted(request))
                if marks is not None:
                    marks["options"], marks["job"] = time.monotonic_ns(), job
                self.loop.submit(job)
                if marks is not None:
                    marks["submitted"] = time.monotonic_ns()
            except Exception as e:  # noqa: BLE001 - a bad or refused request fails alone
                self._fail(sender, e)
        return None

    def _at_once(self, request, req: EncodeRequest, options: EmbedOptions | RerankOptions | ClassifyOptions,
                 marks: dict | None):
        """The response of a query computed on this thread while the encode loop is idle
        (EncodeLoop.run_now: no hand-off to the loop's thread, no response sender); None: the
        loop has work, or this is not a query, so it is queued instead."""
        t0 = time.perf_counter()
        if marks is not None:
            marks["options"] = marks["submitted"] = marks["started"] = time.monotonic_ns()
        try:
            pooled = self.loop.run_now(req)
        except Exception as e:
            self._fatal(e)  # a poisoned device ends this stub, as in the loop
            raise
        if pooled is None:
            return None
        if marks is not None:
            marks["engine_done"] = time.monotonic_ns()
            marks.update(self.engine.last_step_marks)  # gathered ... launched, on_host
        with self.metrics_lock:
            self.metrics.observe_at_once(int(req.input_ids.size), time.perf_counter() - t0)
            if not self.cfg.metrics_flush_s:  # (asked for after every batch; otherwise the idle loop
                # tells Triton within a second: a flush is an IPC per counter, and every tenth one
                # per histogram bucket, which this request would wait for)
                self.metrics.update(self.engine.stats)
        if marks is not None:
            marks["metered"] = time.monotonic_ns()
        tensors = self._tensors(options, req, request.requested_output_names(), pooled)
        if marks is not None:
            marks["outputs"] = time.monotonic_ns()
        response = pb_utils.InferenceResponse(tensors)
        if marks is not None:
            marks["built"] = marks["sent"] = time.monotonic_ns()
        return response

    def _deliver(self, sender, options: EmbedOptions | RerankOptions | ClassifyOptions, marks: dict | None,
                 req: EncodeRequest, wanted: set[str], pooled: np.ndarray) -> None:
        if marks is not None:
            marks["engine_done"], marks["started"] = time.monotonic_ns(), int(marks.pop("job").started_at * 1e9)
            marks["metered"] = marks["engine_done"]  # (the loop meters its steps itself)
        tensors = self._tensors(options, req, wanted, pooled)
        if marks is not None:
            marks["outputs"] = time.monotonic_ns()
        response = pb_utils.InferenceResponse(tensors)
        if marks is not None:
            marks["built"] = time.monotonic_ns()
        # `tensors` outlives send(): Triton 2.51's stub (python_backend r24.10) drops the outputs a
        # request did not ask for inside send() with the GIL released, and a numpy array freed
        # there kills a Python >= 3.12 stub (python_backend #390, fixed in Triton 2.53). _tensors
        # builds only what was asked for; this keeps any other tensor alive past the send as well.
        sender.send(response, flags=FINAL)
        del tensors
        if marks is not None:
            marks["sent"] = time.monotonic_ns()

    def _tensors(self, options: EmbedOptions | RerankOptions | ClassifyOptions, req: EncodeRequest,
                 wanted: set[str], pooled: np.ndarray) -> list:
        """The response's output tensors, those in `wanted` only."""
        if isinstance(options, ClassifyOptions):
            outputs = {"PROBS": activate(pooled, self.activation, options.raw_scores), "LABELS": self.labels}
        elif isinstance(options, RerankOptions):
            score = activate(pooled[:, :1], self.activation, options.raw_scores)[:, 0]  # [n], input order
            outputs = {"SCORE": score, "INDICES": rank(score, options.top_n)}
        else:
            outputs = self._embeddings(options, req, pooled, wanted)
        # Only the outputs asked for: each costs a tensor in shared memory and an output in the server
        # (a direct call that names EMBEDDING gets 1 instead of 9; an ensemble asks for all it maps).
        return [pb_utils.Tensor(k, v) for k, v in outputs.items() if k in wanted]

    def _embeddings(self, options: EmbedOptions, req: EncodeRequest, pooled: np.ndarray,
                    wanted: set[str]) -> dict[str, np.ndarray]:
        """Those of EMBEDDING* ([n, 0] when OUTPUTS leaves out dense) and bge-m3's ragged SPARSE_* /
        TOKEN_* (empty unless OUTPUTS asks for them) that the caller wants: an ensemble maps them
        all, a direct caller usually names one. Only those: on the stub's path every numpy call
        costs microseconds (perf/results/2026-12-05-eb8e445-cpu/NOTES.md)."""
        outputs = {}
        if options.spans is not None:
            pooled = self.engine.late_vectors(req, options.spans)
        if not EMBEDDING_TENSORS.isdisjoint(wanted):
            dense = pooled if "dense" in options.outputs else pooled[:, :0]
            outputs = encoded_outputs(finish(dense, options.dimensions, options.normalize), options.encoding, wanted)
        if not TOKEN_TENSORS.isdisjoint(wanted):
            outputs |= token_outputs(self.engine.spec, options.outputs, req.input_ids, req.lengths, req.token_rows,
                                     self.skipped_ids)
        return outputs

    @classmethod
    def _fail(cls, sender, exc: BaseException) -> None:
        sender.send(cls._error_response(exc), flags=FINAL)

    @staticmethod
    def _error_response(exc: BaseException):
        codes = {Overloaded: "UNAVAILABLE", Unloading: "UNAVAILABLE", Cancelled: "CANCELLED"}
        code = next((c for cls, c in codes.items() if isinstance(exc, cls)), None)
        if code is None:
            return inference_error(pb_utils, exc)
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc), getattr(pb_utils.TritonError, code)))

    def _fatal(self, exc: BaseException) -> bool:
        """A poisoned CUDA context cannot serve again: fail everything and end this stub."""
        if not is_fatal_device_error(exc):
            return False
        exit_soon(pb_utils, self.model_name, exc)
        return True

    def finalize(self) -> None:
        self.loop.stop()
        self.metrics.flush(self.engine.stats)  # counts still waiting for the flush interval
        self.metrics.close()
        if self.timing is not None:
            self.timing.write()
