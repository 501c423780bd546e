"""Triton adapter for <name>_tokenizer: TEXT (+ options) -> flat token ids for the encoder."""

import numpy as np
import triton_python_backend_utils as pb_utils

from pergola.config import EngineConfig
from pergola.errors import RequestError, decode_utf8
from pergola.tokenization import TextTokenizer
from pergola.triton_io import embed_options, error_response, optional_scalar


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.cfg = EngineConfig.from_triton_args(args)
        self.spec = self.cfg.spec()
        self.tokenizer = TextTokenizer(self.spec, self.cfg.max_texts)

    def execute(self, requests: list) -> list:
        return [self._execute_one(r) for r in requests]

    def _execute_one(self, request) -> "pb_utils.InferenceResponse":
        try:
            raw = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            if raw.ndim != 1:
                raise RequestError(f"TEXT must be 1-D ([n] strings), got shape {list(raw.shape)}")
            texts = decode_utf8(raw.tolist())
            dims, normalize, encoding = embed_options(pb_utils, request, self.spec.hidden_size, self.spec.normalize)
            truncate = optional_scalar(pb_utils, request, "TRUNCATE")
            enc = self.tokenizer.encode(
                texts,
                prompt_name=optional_scalar(pb_utils, request, "PROMPT_NAME"),
                truncate=self.cfg.truncate if truncate is None else bool(truncate),
            )
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return error_response(pb_utils, e)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_IDS", enc.input_ids[None, :]),
            pb_utils.Tensor("LENGTHS", enc.lengths[None, :]),
            pb_utils.Tensor("PROMPT_LENGTHS", enc.prompt_lengths[None, :]),
            pb_utils.Tensor("DIMENSIONS_OUT", np.array([[dims]], dtype=np.int32)),
            pb_utils.Tensor("NORMALIZE_OUT", np.array([[normalize]], dtype=bool)),
            pb_utils.Tensor("ENCODING_OUT", np.array([[encoding.encode()]], dtype=object)),
            pb_utils.Tensor("TOKEN_COUNT", enc.lengths),
        ])
