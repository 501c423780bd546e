"""Triton adapter for <name>_encoder: ragged token ids -> embeddings [n, dim] in the ENCODING
asked for (pergola.encodings: EMBEDDING FP32 by default), or for a reranker, SCORE [n] (input
order) and INDICES (best first, TOP_N of them when given).

Triton's dynamic batcher hands over every queued request at once; the engine packs all their
sequences into token-budgeted steps, so one request may share a step with others.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from pergola.config import EngineConfig
from pergola.encodings import DEFAULT_ENCODING, encoded_outputs
from pergola.engine import EncodeRequest, Engine
from pergola.metrics import EncoderMetrics
from pergola.pooling import finish
from pergola.triton_io import (embed_options, error_response, exit_soon, instance_device,
                               is_fatal_device_error, optional_scalar, required_array, set_cpu_threads)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.model_name = args["model_name"]
        self.cfg = EngineConfig.from_triton_args(args, device=instance_device(args))
        threads = set_cpu_threads(self.cfg)
        self.engine = Engine(self.cfg)
        self.hidden = self.engine.spec.hidden_size
        self.rerank = self.engine.spec.task == "rerank"
        runner = self.engine.runner
        attention = runner.attention_in_use()
        pb_utils.Logger.log_info(f"{args['model_name']}: device {self.cfg.device}, attention {attention}, "
                                 f"CUDA graphs {'on' if runner.graphs is not None else 'off'}"
                                 f"{'' if threads is None else f', {threads} CPU threads'}; "
                                 f"start-up: {runner.startup_line()}")
        if runner.probe is not None and len(runner.probe.micros) > 1:
            pb_utils.Logger.log_info(f"{args['model_name']}: attention probe, µs per layer call: "
                                     f"{runner.probe.micros}")
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], attention)

    def _decode(self, request) -> tuple[EncodeRequest, int, bool, str]:
        """-> (request, DIMENSIONS or a reranker's TOP_N, NORMALIZE, ENCODING)."""
        optional = {name: pb_utils.get_input_tensor_by_name(request, name)
                    for name in ("PROMPT_LENGTHS", "TOKEN_TYPE_IDS")}
        optional = {k: None if v is None else v.as_numpy().reshape(-1) for k, v in optional.items()}
        req = EncodeRequest(
            input_ids=required_array(pb_utils, request, "INPUT_IDS", np.int64),
            lengths=required_array(pb_utils, request, "LENGTHS", np.int32),
            prompt_lengths=optional["PROMPT_LENGTHS"],
            token_types=optional["TOKEN_TYPE_IDS"],
        )
        self.engine.validate(req)
        if self.rerank:
            return req, int(optional_scalar(pb_utils, request, "TOP_N") or 0), False, DEFAULT_ENCODING
        return (req, *embed_options(pb_utils, request, self.hidden, self.engine.spec.normalize))

    @staticmethod
    def _rerank_response(scores: np.ndarray, top_n: int) -> "pb_utils.InferenceResponse":
        score = np.ascontiguousarray(scores[:, 0], dtype=np.float32)  # [n], input order
        order = np.argsort(-score, kind="stable").astype(np.int32)
        return pb_utils.InferenceResponse([pb_utils.Tensor("SCORE", score),
                                           pb_utils.Tensor("INDICES", order[:top_n] if top_n else order)])

    @staticmethod
    def _embed_response(pooled: np.ndarray, dims: int, normalize: bool,
                        encoding: str) -> "pb_utils.InferenceResponse":
        outputs = encoded_outputs(finish(pooled, dims, normalize), encoding)
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()])

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        accepted = []  # (position, request, dims or top_n, normalize, encoding)
        for i, request in enumerate(requests):
            try:
                accepted.append((i, *self._decode(request)))
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                responses[i] = error_response(pb_utils, e)
        try:
            pooled = self.engine.encode([a[1] for a in accepted])
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: fail this batch, keep serving
            for i, *_ in accepted:
                responses[i] = error_response(pb_utils, e)
            if is_fatal_device_error(e):  # a poisoned CUDA context: let the supervisor reload us
                exit_soon(pb_utils, self.model_name, e)
            return responses
        for (i, _, option, normalize, encoding), out in zip(accepted, pooled):
            responses[i] = self._rerank_response(out, option) if self.rerank else \
                self._embed_response(out, option, normalize, encoding)
        self.metrics.update(self.engine.stats)
        return responses

    def finalize(self) -> None:
        self.metrics.flush()  # counts still waiting for the flush interval
