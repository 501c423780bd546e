"""Triton adapter for a reranker's NAME_tokenizer: QUERY + DOCUMENTS -> one pair sequence each."""

import numpy as np
import triton_python_backend_utils as pb_utils

from pergola.config import EngineConfig
from pergola.errors import RequestError, decode_utf8
from pergola.rerank import RerankTokenizer
from pergola.triton_io import error_response, optional_scalar


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.cfg = EngineConfig.from_triton_args(args)
        spec = self.cfg.spec()
        self.tokenizer = RerankTokenizer(spec, spec.reranker_kind, max_documents=self.cfg.max_texts)

    def execute(self, requests: list) -> list:
        return [self._execute_one(r) for r in requests]

    def _execute_one(self, request) -> "pb_utils.InferenceResponse":
        try:
            query = decode_utf8(pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1).tolist(),
                                "QUERY")
            if len(query) != 1:
                raise RequestError(f"QUERY takes exactly one string, got {len(query)}")
            raw = pb_utils.get_input_tensor_by_name(request, "DOCUMENTS").as_numpy()
            if raw.ndim != 1:
                raise RequestError(f"DOCUMENTS must be 1-D ([n] strings), got shape {list(raw.shape)}")
            documents = decode_utf8(raw.tolist(), "DOCUMENTS")
            top_n = int(optional_scalar(pb_utils, request, "TOP_N") or 0)
            if top_n < 0:
                raise RequestError(f"TOP_N={top_n} must be positive (0 or omitted = all documents)")
            truncate = optional_scalar(pb_utils, request, "TRUNCATE")
            enc = self.tokenizer.encode(query[0], documents,
                                        truncate=self.cfg.truncate if truncate is None else bool(truncate))
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return error_response(pb_utils, e)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_IDS", enc.input_ids[None, :]),
            pb_utils.Tensor("LENGTHS", enc.lengths[None, :]),
            pb_utils.Tensor("TOKEN_TYPE_IDS", enc.token_type_ids[None, :]),
            pb_utils.Tensor("TOP_N_OUT", np.array([[top_n]], dtype=np.int32)),
        ])
