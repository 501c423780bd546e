"""BERT family encoder (BERT, MiniLM, ...) over flat tokens: [num_tokens, hidden], no padding.

Module and weight names follow Hugging Face's `BertModel`, so checkpoints load by name; the
query/key/value projections are one fused `qkv` matmul, loaded part by part (`packed_modules_mapping`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergola.hf_folder import head_dim
from pergola.layers.attention import AttentionBackend, AttentionMetadata
from pergola.layers.linear import Linear, MergedLinear
from pergola.models import Model

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = head_dim(cfg)
        self.qkv = MergedLinear(h, [h, h, h], bias=True)  # fused query | key | value

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        return attn(q, k, v, meta).reshape(t, -1)


class BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("layer_norm_eps", 1e-12)
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(h, h, bias=True)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(h, inter, bias=True)
        self.output = nn.Module()
        self.output.dense = Linear(inter, h, bias=True)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.act = ACTIVATIONS[cfg.get("hidden_act", "gelu")]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend) -> torch.Tensor:
        a = self.attention.self(x, meta, attn)
        x = self.attention.output.LayerNorm(self.attention.output.dense(a) + x)
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(y + x)


class BertModel(Model):
    """Returns the last hidden states [num_tokens, hidden] of a ragged batch."""

    # checkpoint name -> (fused parameter, shard index)
    packed_modules_mapping = {
        "attention.self.query": ("attention.self.qkv", 0),
        "attention.self.key": ("attention.self.qkv", 1),
        "attention.self.value": ("attention.self.qkv", 2),
    }
    checkpoint_prefixes = ("bert.", "model.")
    causal = False

    def __init__(self, cfg: dict[str, Any], task: str = "embed") -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        if task == "rerank":  # BertForSequenceClassification's head: pooler (dense + tanh), classifier
            h = cfg["hidden_size"]
            self.pooler = nn.Module()
            self.pooler.dense = Linear(h, h, bias=True)
            self.classifier = Linear(h, len(cfg.get("id2label") or {0: "LABEL_0"}), bias=True)

    def score(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[B, hidden] fp32 [CLS] states -> [B, num_labels] fp32 scores.

        One label: sigmoid, as sentence-transformers' CrossEncoder applies by default; several:
        the raw logits."""
        x = torch.tanh(self.pooler.dense(cls_states.to(self.pooler.dense.weight.dtype)))
        logits = self.classifier(x).float()
        return torch.sigmoid(logits) if logits.shape[1] == 1 else logits

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_types)
        for layer in self.encoder.layer:
            x = layer(x, meta, attn)
        return x
