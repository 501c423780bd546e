"""Sequence-scoring heads: what a reranker's or a classifier's logits become in an answer.

The model returns logits ([n, num_labels] fp32; a Qwen3-Reranker's one column is
logit(yes) - logit(no)), and the adapter applies the activation here, so a request for raw
scores (RAW_SCORES) and one for probabilities are answered from the same forward pass, and the
GPU path's static [max_seqs, num_labels] buffers and CUDA graphs do not depend on the request.

* rerank: sigmoid, as sentence-transformers' CrossEncoder applies to one label by default, and
  sigmoid(yes - no) = softmax([no, yes])[yes], the Qwen3-Reranker reference's P(yes).
* classify: softmax over the labels, or a sigmoid per label where the config says
  `problem_type: multi_label_classification` (as transformers' pipeline does).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pergola.config.hf_folder import ModelSpec

Activation = Literal["sigmoid", "softmax"]
LABELS_PARAMETER = "labels"  # a classifier's encoder config.pbtxt: its label names, a JSON list
MAX_INPUT_PARAMETER = "max_input_length"  # every model's config.pbtxt: its longest input in tokens
PROMPTS_PARAMETER = "prompt_names"  # an embedding model's config.pbtxt: the names of its prompts, a JSON list
# Tasks whose answer is a head's output per sequence ([n, num_labels]) rather than a pooled embedding.
HEAD_TASKS = ("rerank", "classify")


def activation(spec: ModelSpec) -> Activation:
    """The activation a folder's scores get unless raw scores are asked for."""
    if spec.task == "classify" and spec.hf_config.get("problem_type") != "multi_label_classification":
        return "softmax"
    return "sigmoid"


def activate(logits: np.ndarray, how: Activation, raw: bool = False) -> np.ndarray:
    """logits [n, labels] -> [n, labels] float32 probabilities (or the logits themselves, `raw`).

    Computed in float64: a float32 exp overflows past |x| = 88, where the probability is 0 or 1."""
    if raw:
        return np.ascontiguousarray(logits, dtype=np.float32)
    x = logits.astype(np.float64)
    if how == "sigmoid":
        return (0.5 * (1.0 + np.tanh(0.5 * x))).astype(np.float32)  # = 1 / (1 + e^-x), without overflow
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def label_names(spec: ModelSpec) -> list[str]:
    """The labels in column order: config `id2label` (its keys are strings in config.json)."""
    id2label = spec.hf_config.get("id2label") or {0: "LABEL_0"}
    names = {int(k): str(v) for k, v in id2label.items()}
    return [names.get(i, f"LABEL_{i}") for i in range(len(names))]
