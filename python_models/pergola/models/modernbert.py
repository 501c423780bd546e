"""ModernBERT encoder (gte-modernbert, nomic-modernbert, gte-reranker-modernbert) over flat tokens: [T, hidden].

Unpadded, as ModernBERT was designed. Module and weight names follow Hugging Face's
`ModernBertModel` (its q/k/v and the GeGLU's input/gate are already one matmul each: `Wqkv`, `Wi`).
As HF computes it: pre-norm LayerNorms without bias (the first layer has no attention norm),
no biases in the projections, RoPE with a global base on full layers and a local base on
sliding ones, and the GLU `act(input) * gate`. Every `global_attn_every_n_layers`-th layer
(from the first) attends to the whole sequence; the others to keys with |q - k| <= local_attention / 2.

The ragged attention backends take no window: a sliding layer uses them when no sequence of the
step is longer than the half-window + 1 (then the window excludes nothing), and otherwise
models/padded.py's BandAttention: on the GPU pergola's Triton kernel walking each block's band
of keys (head_dim 64), on the CPU SDPA over a padded grid. On the GPU a layer is 9 kernels:
LayerNorm, Wqkv, RoPE (in place), attention, Wo (+ residual), LayerNorm, Wi, GELU * gate,
Wo (+ residual) (pergola.layers.fused).

`ModernBertForSequenceClassification` rerankers: `classifier_pooling` (CLS or mean) -> head
(dense, activation, LayerNorm) -> classifier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pergola.config.hf_folder import ModelFolderError, head_dim
from pergola.layers.attention import AttentionBackend, AttentionMetadata, attend_rows
from pergola.layers.fused import ACTIVATIONS, LayerNorm, act_and_mul
from pergola.layers.linear import Linear
from pergola.models.loader import Model
from pergola.models.padded import BandAttention
from pergola.models.qwen3 import RotaryEmbedding, apply_rope
from pergola.outputs.heads import HEAD_TASKS

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention: the config's `layer_types` (transformers 5), else every
    `global_attn_every_n_layers`-th layer from layer 0 is full (4.x configs)."""
    every = int(cfg.get("global_attn_every_n_layers", 3))
    return cfg.get("layer_types") or [FULL if i % every == 0 else SLIDING for i in range(cfg["num_hidden_layers"])]


def rope_thetas(cfg: dict[str, Any]) -> dict[str, float]:
    """RoPE base per layer type: `rope_parameters` (transformers 5) or `global_rope_theta` /
    `local_rope_theta` (4.x; 160000 / 10000 by default)."""
    params = cfg.get("rope_parameters") or {}
    thetas = {}
    for kind, key, default in ((FULL, "global_rope_theta", 160000.0), (SLIDING, "local_rope_theta", 10000.0)):
        p = params.get(kind) or {}
        if (p.get("rope_type") or "default") != "default":
            raise ModelFolderError(f"ModernBERT with rope type {p['rope_type']!r} is not supported")
        thetas[kind] = float(p.get("rope_theta") or cfg.get(key) or default)
    return thetas


def layer_norm(cfg: dict[str, Any]) -> LayerNorm:
    return LayerNorm(cfg["hidden_size"], eps=cfg.get("norm_eps", 1e-5), bias=cfg.get("norm_bias", False))


class ModernBertAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_type: str) -> None:
        super().__init__()
        h, bias = cfg["hidden_size"], cfg.get("attention_bias", False)
        self.num_heads, self.head_dim = cfg["num_attention_heads"], head_dim(cfg)
        self.Wqkv = Linear(h, 3 * h, bias=bias)  # q | k | v, heads contiguous in each
        self.Wo = Linear(h, h, bias=bias)
        # Keys with |q - k| < window are seen (HF: <= local_attention // 2).
        self.window = int(cfg.get("local_attention", 128)) // 2 + 1 if layer_type == SLIDING else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata, attn: AttentionBackend, band: BandAttention,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] normalised -> the residual stream [T, hidden] with the attention added in place;
        with `rows` ([B] pooled tokens, a full-attention layer) a new [B, hidden] of those rows."""
        t = x.shape[0]
        q, k, v = self.Wqkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        q, k = apply_rope(q, k, rope, positions)  # in place in the qkv product on the GPU
        if rows is not None:
            out = attend_rows(q[rows], k, v, meta.cu_seqlens, meta.max_seqlen)  # [B, H, D]
            return self.Wo(out.reshape(rows.shape[0], -1), residual[rows])
        if self.window is not None and meta.max_seqlen > self.window:
            out = band(q, k, v, self.window)
        else:
            out = attn(q, k, v, meta)
        return self.Wo(out.reshape(t, -1), residual)


class ModernBertMLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter, bias = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("mlp_bias", False)
        self.Wi = Linear(h, 2 * inter, bias=bias)  # input | gate
        self.Wo = Linear(inter, h, bias=bias)
        self.act = cfg.get("hidden_activation", "gelu")  # a key of ACTIVATIONS

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # x [T, hidden] -> act(input) * gate [T, I] (one kernel on the GPU) -> Wo, added in place
        # to the residual stream [T, hidden] in the matmul's epilogue, which is returned.
        return self.Wo(act_and_mul(self.Wi(x), self.act), residual)


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.attn_norm = layer_norm(cfg) if index > 0 else nn.Identity()  # layer 0: the embedding norm serves
        self.attn = ModernBertAttention(cfg, layer_type)
        self.mlp_norm = layer_norm(cfg)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
                attn: AttentionBackend, band: BandAttention, rows: torch.Tensor | None = None) -> torch.Tensor:
        # The residual adds ride in Wo's epilogues, in place: x is this forward's own stream.
        x = self.attn(self.attn_norm(x), x, positions, rope, meta, attn, band, rows)
        return self.mlp(self.mlp_norm(x), x)


class ModernBertModel(Model):
    """Returns the last hidden states [num_tokens, hidden] (after the final norm) of a ragged batch."""

    checkpoint_prefixes = ("model.",)  # ModernBertForSequenceClassification checkpoints
    causal = False

    def __init__(self, cfg: dict[str, Any], task: str = "embed") -> None:
        super().__init__()
        for key in ("hidden_activation", "classifier_activation"):
            if cfg.get(key, "gelu") not in ACTIVATIONS:
                raise ModelFolderError(f"ModernBERT with {key} {cfg[key]!r} is not supported; "
                                       f"supported: {sorted(ACTIVATIONS)}")
        self.config = cfg
        types = layer_types(cfg)
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.embeddings.norm = layer_norm(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i, types[i]) for i in range(cfg["num_hidden_layers"]))
        self.final_norm = layer_norm(cfg)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head_dim(cfg), cfg["max_position_embeddings"], theta)
                                     for kind, theta in rope_thetas(cfg).items()})
        if task in HEAD_TASKS:  # ModernBertForSequenceClassification: head (dense, act, norm), classifier
            h = cfg["hidden_size"]
            self.head = nn.Module()
            self.head.dense = Linear(h, h, bias=cfg.get("classifier_bias", False))
            self.head.norm = layer_norm(cfg)
            self.classifier = Linear(h, len(cfg.get("id2label") or {0: "LABEL_0"}), bias=True)
            self.head_act = ACTIVATIONS[cfg.get("classifier_activation", "gelu")]

    def post_load(self) -> None:
        for rope in self.rotary.values():
            rope.fill()

    def takes_rows(self, pooling: str) -> bool:
        return self.layers[-1].layer_type == FULL  # attend_rows has no window

    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, hidden] fp32 pooled states (CLS or mean, as classifier_pooling says) -> [B, num_labels]
        fp32 logits (pergola.outputs.heads activates them)."""
        x = self.head.norm(self.head_act(self.head.dense(pooled.to(self.head.dense.weight.dtype))))
        return self.classifier(x).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] ignored (no segment embeddings)
        meta: AttentionMetadata,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,  # [B]: return only these rows' states (Model.takes_rows)
    ) -> torch.Tensor:
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        band = BandAttention(meta, positions, self.config["max_position_embeddings"])
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rotary[layer.layer_type], meta, attn, band, rows if i == last else None)
        return self.final_norm(x)
