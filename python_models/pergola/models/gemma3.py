"""Gemma3 text encoder (google/embeddinggemma-300m) over flat tokens: [T, hidden].

Module and weight names follow Hugging Face's `Gemma3TextModel`; q/k/v and gate/up are one fused
matmul each. What differs from Qwen3, as HF computes it:
  * RMSNorm multiplies by (1 + weight), in fp32, before rounding (Qwen: weight * rounded);
    four norms per layer (input, post-attention, pre- and post-feed-forward), q/k norms per head;
  * token embeddings scaled by sqrt(hidden), the scale rounded to the model dtype first;
  * GeGLU feed-forward (gelu tanh approximation), attention scaled by query_pre_attn_scalar^-0.5;
  * two RoPE tables: the local base for sliding-window layers, the global one for full layers;
  * sliding-window layers see keys within a window (|q - k| < sliding_window // 2 + 1 when
    bidirectional, as EmbeddingGemma is; q - sliding_window < k <= q when causal).

The ragged attention backends take no window. A sliding layer runs on them when no sequence of
the step is longer than the window (then the window excludes nothing), and otherwise on
models/padded.py's BandAttention: on the GPU a kernel with the window (FlashAttention-2's windowed
varlen kernel at this head_dim of 256, graph-safe), on the CPU SDPA over a padded grid with the
band as a mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergola.config.hf_folder import ModelFolderError, head_dim
from pergola.layers.attention import AttentionBackend, AttentionMetadata
from pergola.layers.fused import split_qkv
from pergola.layers.linear import Linear, MergedLinear
from pergola.models.loader import Model
from pergola.models.padded import BandAttention
from pergola.models.qwen3 import Qwen3Model, RotaryEmbedding, apply_rope

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and rounded once (HF's Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def rope_thetas(cfg: dict[str, Any]) -> dict[str, float]:
    """RoPE base per layer type, from a transformers 5 config (`rope_parameters` per layer type)
    or a 4.x one (`rope_theta` global, `rope_local_base_freq` for sliding layers)."""
    params = cfg.get("rope_parameters") or {}
    thetas = {}
    for kind, default in ((FULL, cfg.get("rope_theta", 1000000.0)), (SLIDING, cfg.get("rope_local_base_freq", 10000.0))):
        p = params.get(kind) or {}
        scaling = cfg.get("rope_scaling") if kind == FULL else None
        rope_type = p.get("rope_type") or (scaling or {}).get("rope_type") or "default"
        if rope_type != "default":
            raise ModelFolderError(f"Gemma3 with rope type {rope_type!r} is not supported (only the default RoPE)")
        thetas[kind] = float(p.get("rope_theta") or default)
    return thetas


def sliding_window(cfg: dict[str, Any], causal: bool) -> int:
    """Keys a sliding layer sees are fewer than this many positions away. Bidirectional Gemma3
    (EmbeddingGemma) halves the saved window, as transformers' Gemma3TextConfig does on load
    (`sliding_window // 2 + 1`, exclusive): 512 in config.json is |q - k| < 257."""
    window = int(cfg["sliding_window"])
    return window if causal else window // 2 + 1


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_type: str, causal: bool) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = head_dim(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = MergedLinear(h, [q_size, kv_size, kv_size], bias=bias)  # fused q | k | v
        self.o_proj = Linear(q_size, h, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        # The kernels scale by head_dim^-0.5; Gemma by query_pre_attn_scalar^-0.5 (equal in EmbeddingGemma).
        self.q_scale = (self.head_dim / cfg.get("query_pre_attn_scalar", self.head_dim)) ** 0.5
        self.window = sliding_window(cfg, causal) if layer_type == SLIDING else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
                attn: AttentionBackend, band: BandAttention) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = split_qkv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(self.q_norm(q), self.k_norm(k), rope, positions)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.window is not None and meta.max_seqlen > self.window:
            out = band(q, k, v, self.window)
        else:
            out = attn(q, k, v, meta)
        return self.o_proj(out.reshape(t, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = MergedLinear(h, [inter, inter])  # fused gate | up
        self.down_proj = Linear(inter, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_type: str, causal: bool) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.layer_type = layer_type
        self.self_attn = Gemma3Attention(cfg, layer_type, causal)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
                attn: AttentionBackend, band: BandAttention) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), positions, rope, meta, attn, band)
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(Model):
    """Returns the last hidden states [num_tokens, hidden] (after the final norm) of a ragged batch."""

    packed_modules_mapping = Qwen3Model.packed_modules_mapping  # the same names, fused the same way
    checkpoint_prefixes = ("model.",)

    def __init__(self, cfg: dict[str, Any], causal: bool = False, task: str = "embed") -> None:
        super().__init__()
        if task != "embed":
            raise ModelFolderError("Gemma3 is served as an embedder only")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ModelFolderError(f"Gemma3 with activation {act!r} is not supported (only gelu_pytorch_tanh)")
        if cfg.get("attn_logit_softcapping"):
            raise ModelFolderError("Gemma3 with attention logit soft-capping is not supported")
        h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
        self.config = cfg
        self.causal = causal
        types = cfg.get("layer_types") or [FULL if (i + 1) % cfg.get("sliding_window_pattern", 6) == 0 else SLIDING
                                           for i in range(n)]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], h)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, types[i], causal) for i in range(n))
        self.norm = GemmaRMSNorm(h, cfg.get("rms_norm_eps", 1e-6))
        thetas = rope_thetas(cfg)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head_dim(cfg), cfg["max_position_embeddings"], theta)
                                     for kind, theta in thetas.items()})
        self.embed_scale = 1.0  # sqrt(hidden) in the weights' dtype, set by post_load

    def post_load(self) -> None:
        for rope in self.rotary.values():
            rope.fill()
        # HF rounds the scale to the weight dtype first (sqrt(768) = 27.71 is 27.75 in bf16).
        self.embed_scale = float(torch.tensor(self.config["hidden_size"] ** 0.5, dtype=self.embed_tokens.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] ignored
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        if meta.causal != self.causal:
            raise ValueError(f"attention metadata says causal={meta.causal}, the model was built causal={self.causal}")
        x = self.embed_tokens(input_ids) * self.embed_scale
        band = BandAttention(meta, positions, self.config["max_position_embeddings"])
        for layer in self.layers:
            x = layer(x, positions, self.rotary[layer.layer_type], meta, attn, band)
        return self.norm(x)
