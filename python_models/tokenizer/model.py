"""Triton adapter for <name>_tokenizer: TEXT (+ options) -> flat token ids for the encoder; with
CHUNK_SIZE, the texts cut into windows (`chunking`, pergola.text.chunking)."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils
from pergola.text.tokenization import TextTokenizer
from pergola.triton.adapter import (
    RequestInputs,
    TokenizerAdapter,
    embed_options,
    inference_error,
    optional_count,
    optional_scalar,
    read_truncation,
    required_strings,
)


class TritonPythonModel(TokenizerAdapter):
    def initialize(self, args: dict) -> None:
        cfg = self._setup(pb_utils, args)
        self.spec = cfg.spec()
        self.tokenizer = TextTokenizer(self.spec, cfg.text_limits())

    def _tokens(self, request, inputs: RequestInputs, texts: list) -> "pb_utils.InferenceResponse":
        """Asked for TOKEN_TEXT (the gateway's /tokenize): every token, untruncated, with its text."""
        add_special = optional_scalar(inputs, request, "ADD_SPECIAL_TOKENS")
        self.trimmer.after(sum(map(len, texts)) * 64)  # a str, a bytes and an object slot per token, and copies
        tokens = self.tokenizer.tokenize(texts, prompt_name=optional_scalar(inputs, request, "PROMPT_NAME"),
                                         add_special_tokens=True if add_special is None else bool(add_special))
        return pb_utils.InferenceResponse([
            pb_utils.Tensor("INPUT_IDS", tokens.input_ids[None, :]),
            pb_utils.Tensor("LENGTHS", tokens.lengths[None, :]),
            pb_utils.Tensor("TOKEN_TEXT", np.array([p.encode() for p in tokens.pieces], dtype=object)[None, :]),
            pb_utils.Tensor("TOKEN_OFFSETS", tokens.offsets[None, :]),
        ])

    def _chunks(self, request, inputs: RequestInputs, texts: list) -> "pb_utils.InferenceResponse":
        """Asked with CHUNK_SIZE (the gateway's `chunking`): the texts cut into windows (pergola.text.chunking)."""
        self.trimmer.after(sum(map(len, texts)) * 16)  # the texts' tokens and offsets, and the windows'
        started = time.perf_counter()
        out = self.tokenizer.chunk(texts, size=optional_count(inputs, request, "CHUNK_SIZE"),
                                   overlap=optional_count(inputs, request, "CHUNK_OVERLAP") or 0,
                                   late=bool(optional_scalar(inputs, request, "CHUNK_LATE") or False),
                                   prompt_name=optional_scalar(inputs, request, "PROMPT_NAME"),
                                   limits=self.cfg.chunk_limits())
        return self._respond(pb_utils, out.encoded, started, {
            "PROMPT_LENGTHS": out.encoded.prompt_lengths[None, :],
            "NORMALIZE_OUT": np.array([[self.spec.normalize]], dtype=bool),
            "CHUNK_COUNTS": out.chunks, "CHUNK_SEQUENCES": out.sequences, "CHUNK_TEXT_SPANS": out.spans[None, :],
            "CHUNK_LENGTHS": out.tokens, "CHUNK_SPANS": out.ranges.reshape(1, -1),
        })

    def _execute_one(self, request, inputs: RequestInputs) -> "pb_utils.InferenceResponse":
        try:
            texts = required_strings(inputs, request, "TEXT")  # decoded and size-checked by encode()
            if "TOKEN_TEXT" in request.requested_output_names():
                return self._tokens(request, inputs, texts)
            if optional_count(inputs, request, "CHUNK_SIZE") is not None:
                return self._chunks(request, inputs, texts)
            self.trimmer.after(sum(map(len, texts)) * 8)  # ids, offsets and copies: ~8 bytes a character
            options = embed_options(inputs, request, self.spec.hidden_size, self.spec.normalize, self.spec.outputs)
            started = time.perf_counter()
            enc = self.tokenizer.encode(
                texts,
                prompt_name=optional_scalar(inputs, request, "PROMPT_NAME"),
                truncate=read_truncation(inputs, request, self.cfg.truncate),
                max_tokens=optional_count(inputs, request, "MAX_TOKENS"),
            )
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's error
            return inference_error(pb_utils, e)
        return self._respond(pb_utils, enc, started, {
            "PROMPT_LENGTHS": enc.prompt_lengths[None, :],
            "DIMENSIONS_OUT": np.array([[options.dimensions]], dtype=np.int32),
            "NORMALIZE_OUT": np.array([[options.normalize]], dtype=bool),
            "ENCODING_OUT": np.array([[options.encoding.encode()]], dtype=object),
            "OUTPUTS_OUT": np.array([[name.encode() for name in options.outputs]], dtype=object),
        })
