"""Triton adapter for a reranker's NAME_tokenizer: QUERY + DOCUMENTS -> one pair sequence each."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils
from pergola.text.errors import RequestError
from pergola.text.rerank import RerankTokenizer
from pergola.triton.adapter import (
    RequestInputs,
    TokenizerAdapter,
    inference_error,
    optional_count,
    optional_single,
    read_truncation,
    required_strings,
    rerank_options,
)


class TritonPythonModel(TokenizerAdapter):
    def initialize(self, args: dict) -> None:
        cfg = self._setup(pb_utils, args)
        self.tokenizer = RerankTokenizer(cfg.spec(), config=cfg)  # the folder's kind of reranker

    def _execute_one(self, request, inputs: RequestInputs) -> "pb_utils.InferenceResponse":
        try:
            query = required_strings(inputs, request, "QUERY")
            if len(query) != 1:
                raise RequestError(f"QUERY takes exactly one string, got {len(query)}")
            documents = required_strings(inputs, request, "DOCUMENTS")  # checked by encode()
            self.trimmer.after(sum(map(len, documents)) * 8)
            options = rerank_options(inputs, request)
            started = time.perf_counter()
            enc = self.tokenizer.encode(
                query[0], documents,
                truncate=read_truncation(inputs, request, self.cfg.truncate),
                max_document_tokens=optional_count(inputs, request, "MAX_DOCUMENT_TOKENS"),
                instruction=optional_single(inputs, request, "INSTRUCTION"),  # checked by encode()
            )
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return inference_error(pb_utils, e)
        return self._respond(pb_utils, enc, started, {
            "TOKEN_TYPE_IDS": enc.token_type_ids[None, :],
            "TOP_N_OUT": np.array([[options.top_n]], dtype=np.int32),
            "RAW_SCORES_OUT": np.array([[options.raw_scores]], dtype=bool),
        })
