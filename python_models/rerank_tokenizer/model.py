"""Triton adapter for a reranker's NAME_tokenizer: QUERY + DOCUMENTS -> one pair sequence each."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from pergola.config import EngineConfig
from pergola.memory import HeapTrimmer
from pergola.metrics import TokenizerMetrics
from pergola.errors import RequestError
from pergola.rerank import RerankTokenizer
from pergola.triton_io import (error_response, optional_count, optional_single, read_truncation, required_strings,
                               rerank_options)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.cfg = EngineConfig.from_triton_args(args)
        self.tokenizer = RerankTokenizer(self.cfg.spec(), config=self.cfg)  # the folder's kind of reranker
        self.trimmer = HeapTrimmer()  # a large request's buffers go back to the system (pergola/memory.py)
        self.metrics = TokenizerMetrics(pb_utils, args["model_name"], flush_s=self.cfg.metrics_flush_s)

    def finalize(self) -> None:
        self.metrics.close()

    def execute(self, requests: list) -> list:
        return [self._execute_one(r) for r in requests]

    def _execute_one(self, request) -> "pb_utils.InferenceResponse":
        try:
            query = required_strings(pb_utils, request, "QUERY")
            if len(query) != 1:
                raise RequestError(f"QUERY takes exactly one string, got {len(query)}")
            documents = required_strings(pb_utils, request, "DOCUMENTS")  # checked by encode()
            self.trimmer.after(sum(map(len, documents)) * 8)
            options = rerank_options(pb_utils, request)
            started = time.perf_counter()
            enc = self.tokenizer.encode(
                query[0], documents,
                truncate=read_truncation(pb_utils, request, self.cfg.truncate),
                max_document_tokens=optional_count(pb_utils, request, "MAX_DOCUMENT_TOKENS"),
                instruction=optional_single(pb_utils, request, "INSTRUCTION"),  # checked by encode()
            )
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return error_response(pb_utils, e)
        self.metrics.observe(time.perf_counter() - started)
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_IDS", enc.input_ids[None, :]),
            pb_utils.Tensor("LENGTHS", enc.lengths[None, :]),
            pb_utils.Tensor("TOKEN_TYPE_IDS", enc.token_type_ids[None, :]),
            pb_utils.Tensor("TOP_N_OUT", np.array([[options.top_n]], dtype=np.int32)),
            pb_utils.Tensor("RAW_SCORES_OUT", np.array([[options.raw_scores]], dtype=bool)),
            pb_utils.Tensor("TOKEN_COUNT", enc.lengths),
            pb_utils.Tensor("TRUNCATED", enc.truncated),
        ])
