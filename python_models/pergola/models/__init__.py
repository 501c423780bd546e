"""Model architectures (one file each) and the one registry of what each serves.

Every fact pergola keeps about an architecture is declared once here: the Hugging Face
`model_type` values it reads, its class, whether it is a decoder, the tasks it serves and the
model types whose positions are offset. `pergola.config.hf_folder` derives its checks from this
table; `pergola.models.loader` builds the class it names. Importing this module imports no torch
(the gateway reads model folders too).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One architecture file, pergola/models/<name>.py, and what it serves."""

    name: str
    model_class: str  # the class in that file (a pergola.models.loader.Model)
    model_types: tuple[str, ...]  # the config.json `model_type` values it reads
    # A decoder: last-token pooling by default, causal unless the folder says otherwise
    # (EmbeddingGemma's use_bidirectional_attention); its class takes the `causal` argument.
    decoder: bool = False
    # Tasks besides "embed": "rerank" (sequence classification, or a causal LM's yes/no logits:
    # Qwen3-Reranker, mxbai-rerank-v2), "classify" (sequence classification with several labels).
    tasks: tuple[str, ...] = ("embed",)
    # Of model_types: those whose positions start at padding index + 1 (fairseq numbering).
    offset_positions: tuple[str, ...] = ()


REGISTRY: tuple[Architecture, ...] = (
    # RoBERTa and XLM-RoBERTa are BERT with another position numbering and head.
    Architecture("bert", "BertModel", ("bert", "roberta", "xlm-roberta"), tasks=("embed", "rerank", "classify"),
                 offset_positions=("roberta", "xlm-roberta")),
    Architecture("mpnet", "MPNetModel", ("mpnet",), offset_positions=("mpnet",)),
    Architecture("modernbert", "ModernBertModel", ("modernbert",), tasks=("embed", "rerank", "classify")),
    Architecture("qwen3", "Qwen3Model", ("qwen2", "qwen3"), decoder=True, tasks=("embed", "rerank", "classify")),
    Architecture("gemma3", "Gemma3TextModel", ("gemma3_text",), decoder=True),
)
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in REGISTRY}
# HF model_type -> its architecture.
MODEL_TYPES: dict[str, Architecture] = {t: a for a in REGISTRY for t in a.model_types}


def model_types(task: str) -> list[str]:
    """The model types served for `task` ("embed", "rerank", "classify"), in registry order."""
    return [t for a in REGISTRY if task in a.tasks for t in a.model_types]


def offset_positions(model_type: str | None) -> bool:
    """Whether positions of this model type start at padding index + 1."""
    return model_type in MODEL_TYPES and model_type in MODEL_TYPES[model_type].offset_positions


def model_class(architecture: str) -> type:
    """The class of `architecture` (imports its file, and torch)."""
    return getattr(importlib.import_module(f"pergola.models.{architecture}"), ARCHITECTURES[architecture].model_class)
