"""Embedding encodings (the ENCODING option): float32, float16, int8 or packed sign bits.

Applied last, to the finished embeddings (pooled, Matryoshka-truncated, L2-normalised):
    float32  [n, d] float32   as computed (the default; output EMBEDDING)
    float16  [n, d] float16   plain cast (EMBEDDING_FP16, sent as its UINT16 bit patterns: see below)
    int8     [n, d] int8      round(x * 127), clipped to [-127, 127] (EMBEDDING_INT8)
    binary   [n, ceil(d/8)] uint8  np.packbits(x > 0), big-endian bits per row, zero-padded to
             a whole byte (EMBEDDING_BINARY); sentence-transformers and Cohere call it "ubinary",
             accepted here as an alias. Their signed "binary" is the same codes minus 128, as int8.

EMBEDDING_FP16 travels as UINT16 (the IEEE half-precision bits; numpy: `.view(np.float16)`):
Triton's HTTP/JSON protocol cannot carry FP16 at all, so an FP16 output, even an empty one, would
fail every JSON request that does not list its outputs, the plain `embed` request included.

Every scale is fixed, so a text's vector never depends on what else shares its batch.
sentence-transformers' int8 calibrates per-dimension ranges on the batch being quantised (or a
calibration set): served, the same text would get other codes next to other texts. A fixed 127
fits unit-length vectors (every component lies in [-1, 1]), so int8 needs NORMALIZE=true: a
per-row max-abs scale would silently drop the norms a caller asked to keep by turning it off.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from pergola.text.errors import RequestError

DEFAULT_ENCODING = "float32"
INT8_SCALE = 127.0
# encoding -> (output tensor, its Triton dtype); the ensemble and encoder configs declare the same.
OUTPUTS: dict[str, tuple[str, type]] = {
    "float32": ("EMBEDDING", np.float32),
    "float16": ("EMBEDDING_FP16", np.uint16),
    "int8": ("EMBEDDING_INT8", np.int8),
    "binary": ("EMBEDDING_BINARY", np.uint8),
}
ALIASES = {"ubinary": "binary"}
EMBEDDING_TENSORS = frozenset(name for name, _ in OUTPUTS.values())


def check_encoding(value: str | None, normalize: bool) -> str:
    """The canonical name of an ENCODING value (None = float32); RequestError if it is unknown,
    or int8 of embeddings that are not normalised."""
    encoding = DEFAULT_ENCODING if value is None else ALIASES.get(value, value)
    if encoding not in OUTPUTS:
        allowed = ", ".join([*OUTPUTS, *ALIASES])
        raise RequestError(f"ENCODING={value!r} is unknown; use one of {allowed} (omitted = float32)")
    if encoding == "int8" and not normalize:
        raise RequestError(
            "ENCODING=int8 scales by a fixed 127 and needs unit-length vectors, but normalisation "
            "is off (NORMALIZE=false, or this model does not normalise by default): send "
            "NORMALIZE=true, or ask for float16 or binary"
        )
    return encoding


def quantize(embeddings: np.ndarray, encoding: str) -> np.ndarray:
    """[n, d] float32 -> [n, d] float32/float16/int8, or [n, ceil(d/8)] uint8 for binary."""
    if encoding == "float16":
        return embeddings.astype(np.float16)
    if encoding == "int8":
        return np.clip(np.rint(embeddings * INT8_SCALE), -INT8_SCALE, INT8_SCALE).astype(np.int8)
    if encoding == "binary":
        return np.packbits(embeddings > 0, axis=-1)
    return embeddings


def encoded_outputs(embeddings: np.ndarray, encoding: str,
                    wanted: Collection[str] = EMBEDDING_TENSORS) -> dict[str, np.ndarray]:
    """The embedding outputs in `wanted`, by tensor name, as sent: `encoding`'s in full (always),
    the others [n, 0].

    An ensemble fails a request when an output the client wants (all of them, when it lists
    none) was not produced, so every one wanted is sent; the empty ones cost nothing on the wire."""
    n = embeddings.shape[0]
    out = {name: np.empty((n, 0), dtype=dtype) for name, dtype in OUTPUTS.values() if name in wanted}
    name, wire_dtype = OUTPUTS[encoding]
    out[name] = np.ascontiguousarray(quantize(embeddings, encoding)).view(wire_dtype)
    return out
