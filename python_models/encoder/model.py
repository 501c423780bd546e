"""Triton adapter for <name>_encoder: ragged token ids -> pooled embeddings [n, dim] FP32.

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
        runner = self.engine.runner
        attention = {"graph" if runner.graphs is not None else "eager": runner.attn.name,
                     "eager": runner.eager_attn.name}
        pb_utils.Logger.log_info(f"{args['model_name']}: device {self.cfg.device}, attention {attention}, "
                                 f"CUDA graphs {'on' if runner.graphs is not None else 'off'}")
        self.metrics = EncoderMetrics(pb_utils, args["model_name"], attention)

    def _decode(self, request) -> tuple[EncodeRequest, int, bool]:
        prompt_lengths = pb_utils.get_input_tensor_by_name(request, "PROMPT_LENGTHS")
        req = EncodeRequest(
            input_ids=required_array(pb_utils, request, "INPUT_IDS", np.int64),
            lengths=required_array(pb_utils, request, "LENGTHS", np.int32),
            prompt_lengths=None if prompt_lengths is None else prompt_lengths.as_numpy().reshape(-1),
        )
        self.engine.validate(req)
        dims = int(optional_scalar(pb_utils, request, "DIMENSIONS") or 0)
        if dims:
            check_dimensions(dims, self.hidden)
        normalize = optional_scalar(pb_utils, request, "NORMALIZE")
        return req, dims, self.engine.spec.normalize if normalize is None else bool(normalize)

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
        for (i, _, dims, normalize), emb in zip(accepted, pooled):
            out = finish(emb, dims, normalize)
            responses[i] = pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", out)])
        self.metrics.update(self.engine.stats)
        return responses
