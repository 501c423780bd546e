"""Triton adapter for a classifier's NAME_tokenizer: TEXT (+ TEXT_PAIR) -> one sequence per input."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils
from pergola.text.classify import ClassifyTokenizer
from pergola.triton.adapter import (
    RequestInputs,
    TokenizerAdapter,
    classify_options,
    inference_error,
    read_truncation,
    required_strings,
)


class TritonPythonModel(TokenizerAdapter):
    def initialize(self, args: dict) -> None:
        cfg = self._setup(pb_utils, args)
        self.tokenizer = ClassifyTokenizer(cfg.spec(), cfg.text_limits())

    def _execute_one(self, request, inputs: RequestInputs) -> "pb_utils.InferenceResponse":
        try:
            texts = required_strings(inputs, request, "TEXT")  # decoded and size-checked by encode()
            pairs = (required_strings(inputs, request, "TEXT_PAIR")
                     if inputs.get_input_tensor_by_name(request, "TEXT_PAIR") is not None else None)
            self.trimmer.after((sum(map(len, texts)) + sum(map(len, pairs or []))) * 8)
            options = classify_options(inputs, request)
            started = time.perf_counter()
            enc = self.tokenizer.encode(texts, pairs, truncate=read_truncation(inputs, request, self.cfg.truncate))
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return inference_error(pb_utils, e)
        return self._respond(pb_utils, enc, started, {
            "TOKEN_TYPE_IDS": enc.token_type_ids[None, :],
            "RAW_SCORES_OUT": np.array([[options.raw_scores]], dtype=bool),
        })
