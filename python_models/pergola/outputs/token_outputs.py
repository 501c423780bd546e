"""bge-m3's per-token outputs (FlagEmbedding's BGEM3): sparse lexical weights and ColBERT vectors.

Both come from the last hidden states h [T, H] of the forward pass that gives the dense vector:
  sparse   w_t = ReLU(sparse_linear(h_t)); per text, token id -> the largest w_t of its
           occurrences, leaving out zero weights and the special tokens (cls, eos, pad, unk)
  colbert  v_t = colbert_linear(h_t) / ||colbert_linear(h_t)|| for every token but the text's
           first (CLS)
`pooling.TokenHeads` computes them on the device for every token of every step of a model that has the
heads (inside its CUDA graphs; a matmul of H x H per token, ~0.3% of an XLM-R large forward);
the runner copies them to the host only for steps where a request asked (engine/runner.py). The
rest is per request on the host: `sparse_outputs`, `colbert_outputs`.

Ragged answers: text i's sparse entries are INDICES/VALUES[offsets[i]:offsets[i + 1]] (token ids
ascending), its ColBERT vectors TOKEN_EMBEDDINGS[offsets[i]:offsets[i + 1]] (length - 1 rows).
"""

from __future__ import annotations

import json

import numpy as np

from pergola.config.hf_folder import ModelSpec
from pergola.text.errors import RequestError

DEFAULT_OUTPUTS = ("dense",)
# bge-m3's ragged output tensors, by name: (Triton data type, dims), in the order the embed ensemble
# declares them (pergola.triton.repo_builder), the gateway asks for them and the encoder builds them.
TOKEN_OUTPUT_TYPES = {"SPARSE_INDICES": ("INT64", "-1"), "SPARSE_VALUES": ("FP32", "-1"),
                      "SPARSE_OFFSETS": ("INT64", "-1"), "TOKEN_EMBEDDINGS": ("FP32", "-1, -1"),
                      "TOKEN_OFFSETS": ("INT64", "-1")}
TOKEN_TENSORS = frozenset(TOKEN_OUTPUT_TYPES)
# The special tokens FlagEmbedding leaves out of the lexical weights (its `unused_tokens`).
SKIPPED_SPECIALS = ("cls_token", "eos_token", "pad_token", "unk_token")


def check_outputs(asked: list[str] | None, offered: tuple[str, ...]) -> tuple[str, ...]:
    """The OUTPUTS a request asks for (None: the dense vector), each once, in the order asked;
    RequestError naming what this model offers when it does not give one of them."""
    if asked is None:
        return DEFAULT_OUTPUTS
    if not asked:
        raise RequestError(f"OUTPUTS is empty; ask for one or more of {', '.join(offered)} (omitted = dense)")
    missing = [a for a in asked if a not in offered]
    if missing:
        heads = "" if len(offered) > 1 else (" (sparse and colbert are bge-m3's, from sparse_linear.pt and "
                                             "colbert_linear.pt in the model folder)")
        raise RequestError(f"OUTPUTS {', '.join(map(repr, missing))} not offered: this model gives "
                           f"{', '.join(offered)}{heads}")
    return tuple(dict.fromkeys(asked))


def row_width(outputs: tuple[str, ...], token_width: int) -> int:
    """Columns of the per-token rows a request needs: none for dense alone, the sparse weight
    (column 0) alone for sparse, all of them (runner.token_width) with colbert."""
    return token_width if "colbert" in outputs else int("sparse" in outputs)


def skipped_token_ids(spec: ModelSpec) -> np.ndarray:
    """The ids of the tokenizer's cls, eos, pad and unk tokens (those it has), which the sparse
    output leaves out, as FlagEmbedding does; from tokenizer_config.json / special_tokens_map.json."""
    if "sparse" not in spec.token_heads:
        return np.empty(0, dtype=np.int64)
    from tokenizers import Tokenizer

    names: dict[str, object] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        path = spec.path / file
        if path.is_file():
            names.update({k: v for k, v in json.loads(path.read_text(encoding="utf-8")).items()
                          if k in SKIPPED_SPECIALS and v})
    tokenizer = Tokenizer.from_file(str(spec.tokenizer_file))
    ids = set()
    for value in names.values():
        token = value.get("content") if isinstance(value, dict) else value
        token_id = tokenizer.token_to_id(str(token))
        if token_id is not None:
            ids.add(token_id)
    return np.array(sorted(ids), dtype=np.int64)


def sparse_outputs(ids: np.ndarray, lengths: np.ndarray, weights: np.ndarray, skipped: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per text, token id -> its largest weight (zero weights and `skipped` ids left out).

    ids [T] int64 and weights [T] fp32 of texts of `lengths` [n], concatenated ->
    (indices [nnz] int64 ascending per text, values [nnz] fp32, offsets [n + 1] int64)."""
    seq = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    keep = (weights > 0) & ~np.isin(ids, skipped)
    seq, tok, w = seq[keep], ids[keep], weights[keep]
    order = np.lexsort((tok, seq))  # by text, then token id
    seq, tok, w = seq[order], tok[order], w[order]
    first = np.ones(tok.size, dtype=bool)
    first[1:] = (seq[1:] != seq[:-1]) | (tok[1:] != tok[:-1])
    starts = np.flatnonzero(first)
    values = np.maximum.reduceat(w, starts) if starts.size else np.empty(0, np.float32)
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(seq[starts], minlength=lengths.size), out=offsets[1:])
    return tok[starts].astype(np.int64), values.astype(np.float32), offsets


def colbert_outputs(lengths: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vectors [T, D] of texts of `lengths` [n] -> (each text's rows but its first (CLS),
    [T - n, D] fp32; offsets [n + 1] int64)."""
    firsts = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1], out=firsts[1:])
    keep = np.ones(vectors.shape[0], dtype=bool)
    keep[firsts] = False
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths - 1, out=offsets[1:])
    return np.ascontiguousarray(vectors[keep], dtype=np.float32), offsets


def token_outputs(spec: ModelSpec, outputs: tuple[str, ...], ids: np.ndarray, lengths: np.ndarray,
                  rows: np.ndarray | None, skipped: np.ndarray) -> dict[str, np.ndarray]:
    """The ragged output tensors of a request, by name: SPARSE_* and TOKEN_* from its per-token
    rows [T, width] (TokenHeads' columns), empty ([0]) for those it did not ask for."""
    dim = rows.shape[1] - ("sparse" in spec.token_heads) if rows is not None else 0
    out = {"SPARSE_INDICES": np.empty(0, np.int64), "SPARSE_VALUES": np.empty(0, np.float32),
           "SPARSE_OFFSETS": np.empty(0, np.int64), "TOKEN_EMBEDDINGS": np.empty((0, dim), np.float32),
           "TOKEN_OFFSETS": np.empty(0, np.int64)}
    if "sparse" in outputs:
        out["SPARSE_INDICES"], out["SPARSE_VALUES"], out["SPARSE_OFFSETS"] = sparse_outputs(
            ids, lengths.astype(np.int64), rows[:, 0], skipped)
    if "colbert" in outputs:
        first = 1 if "sparse" in spec.token_heads else 0
        out["TOKEN_EMBEDDINGS"], out["TOKEN_OFFSETS"] = colbert_outputs(lengths.astype(np.int64), rows[:, first:])
    return out
