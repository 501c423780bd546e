"""Triton adapter for <name>_encoder: ragged token ids -> embeddings [n, dim] FP32, or for a
reranker, SCORE [n] (input order) and INDICES (best first, TOP_N of them when given).

Triton's dynamic batcher hands over every queued request at once; the engine packs all their
sequences into token-budgeted steps, so one request may share a step with others.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from pergola.config import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.metrics import EncoderMetrics
from pergola.pooling import check_dimensions, finish
from pergola.triton_io import error_response, instance_device, optional_scalar, required_array


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.cfg = EngineConfig.from_triton_args(args, device=instance_device(args))
        self.engine = Engine(self.cfg)
        self.hidden = self.engine.spec.hidden_size
        self.rerank = self.engine.spec.task == "rerank"
        runner = self.engine.runner
        attention = {"graph" if runner.graphs is not None else "eager": runner.attn.name,
                     "eager": runner.eager_attn.name}
        pb_utils.Logger.log_info(f"{args['model_name']}: device {self.cfg.device}, attention {attention}, "
                                 f"CUDA graphs {'on' if runner.graphs is not None else 'off'}")
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], attention)

    def _decode(self, request) -> tuple[EncodeRequest, int, bool]:
        """-> (request, DIMENSIONS or a reranker's TOP_N, NORMALIZE)."""
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
            return req, int(optional_scalar(pb_utils, request, "TOP_N") or 0), False
        dims = int(optional_scalar(pb_utils, request, "DIMENSIONS") or 0)
        if dims:
            check_dimensions(dims, self.hidden)
        normalize = optional_scalar(pb_utils, request, "NORMALIZE")
        return req, dims, self.engine.spec.normalize if normalize is None else bool(normalize)

    @staticmethod
    def _rerank_response(scores: np.ndarray, top_n: int) -> "pb_utils.InferenceResponse":
        score = np.ascontiguousarray(scores[:, 0], dtype=np.float32)  # [n], input order
        order = np.argsort(-score, kind="stable").astype(np.int32)
        return pb_utils.InferenceResponse([pb_utils.Tensor("SCORE", score),
                                           pb_utils.Tensor("INDICES", order[:top_n] if top_n else order)])

    def execute(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        accepted = []  # (position, request, dims, normalize)
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
            return responses
        for (i, _, option, normalize), out in zip(accepted, pooled):
            responses[i] = self._rerank_response(out, option) if self.rerank else \
                pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", finish(out, option, normalize))])
        self.metrics.update(self.engine.stats)
        return responses
