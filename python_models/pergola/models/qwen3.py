"""Qwen3 decoder as an embedding model (Qwen3-Embedding, pplx-embed) over flat tokens: [T, hidden].

Module and weight names follow Hugging Face's `Qwen3Model`, so checkpoints load by name; q/k/v
and gate/up are fused into one matmul each at load (`packed_modules_mapping`). No KV cache and
no lm_head: an embedding needs the last hidden states only. Numerics follow HF: matmuls and
residual adds in the model dtype, RMSNorm statistics in fp32, RoPE tables computed in fp32.
Attention is causal (Qwen3-Embedding) or bidirectional (pplx-embed), decided by the folder.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergola.hf_folder import ModelFolderError
from pergola.layers.attention import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, indexed by each token's position (ragged-friendly)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        # Filled by `fill()` after the module leaves the meta device; [max_positions, head_dim / 2].
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)

    @torch.no_grad()
    def fill(self) -> None:
        # Same arithmetic as HF (fp32 inverse frequencies and angles), then cast to the model dtype.
        device = self.cos.device
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        pos = torch.arange(self.max_positions, device=device, dtype=torch.float)
        freqs = pos[:, None] * inv_freq.to(device)[None, :]  # [P, D/2]
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T] -> cos, sin [T, 1, D/2] (broadcast over heads)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in half-split (NeoX) layout, as HF's rotate_half; cos/sin [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = cfg.get("head_dim") or h // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias, eps = cfg.get("attention_bias", False), cfg.get("rms_norm_eps", 1e-6)
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)  # fused q | k | v
        self.o_proj = nn.Linear(self.q_size, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D/2]
        sin: torch.Tensor,  # [T, 1, D/2]
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.view(t, self.num_heads, self.head_dim)), cos, sin)  # [T, Hq, D]
        k = apply_rope(self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]; backends handle GQA
        return self.o_proj(attn(q, k, v, meta).reshape(t, self.q_size))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)  # fused gate | up
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [T, intermediate]
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend
    ) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta from a transformers 4 (`rope_theta`) or 5 (`rope_parameters`) config."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelFolderError(f"Qwen3 with rope type {rope_type!r} is not supported (only the default RoPE)")
    return float(params.get("rope_theta") or cfg.get("rope_theta", 10000.0))


class Qwen3Model(nn.Module):
    """Returns the last hidden states [num_tokens, hidden] (after the final norm) of a ragged batch."""

    # checkpoint name -> (fused parameter, shard index)
    packed_modules_mapping = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    checkpoint_prefixes = ("model.",)  # Qwen3ForCausalLM checkpoints; lm_head.* is skipped

    def __init__(self, cfg: dict[str, Any], causal: bool = True) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelFolderError(f"Qwen3 with hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        if cfg.get("use_sliding_window"):
            raise ModelFolderError("Qwen3 with sliding-window attention is not supported")
        self.config = cfg
        self.causal = causal
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(head_dim, cfg["max_position_embeddings"], _rope_theta(cfg))

    def post_load(self) -> None:
        self.rotary_emb.fill()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] ignored (no segment embeddings)
        meta: AttentionMetadata,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        if meta.causal != self.causal:
            raise ValueError(f"attention metadata says causal={meta.causal}, the model was built causal={self.causal}")
        cos, sin = self.rotary_emb(positions)  # [T, 1, D/2] each, gathered once for all layers
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, cos, sin, meta, attn)
        return self.norm(x)
