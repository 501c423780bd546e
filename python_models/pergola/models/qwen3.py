"""Qwen3 and Qwen2 decoders as embedding models (Qwen3-Embedding, pplx-embed, gte-Qwen2) over flat tokens: [T, hidden],
and as rerankers / classifiers: a causal LM's yes/no answer logits (Qwen3-Reranker, mxbai-rerank-v2),
or a ForSequenceClassification `score` layer over the last token.

Qwen2 is the same network without the per-head q/k RMSNorm and with biases on the q/k/v
projections (not on o); the config's `model_type` decides, and RoPE then runs on its own.

Module and weight names follow Hugging Face's `Qwen3Model`, so checkpoints load by name; q/k/v
and gate/up are one fused matmul each, loaded part by part (`packed_modules_mapping`). No KV cache and
no lm_head: an embedding needs the last hidden states only. Numerics follow HF: matmuls in the
model dtype, RMSNorm statistics in fp32, RoPE tables computed in fp32; the one difference is the
residual add, done in the o/down matmuls' epilogue in fp32 and rounded once (HF rounds the
product, then the sum).
Attention is causal (Qwen3-Embedding) or bidirectional (pplx-embed), decided by the folder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pergola.config.hf_folder import ModelFolderError, head_dim, sequence_classification
from pergola.layers.attention import AttentionBackend, AttentionMetadata, attend_rows
from pergola.layers.fused import PendingNorm, qk_norm_rope, rms_norm, rope_qk, split_qkv
from pergola.layers.linear import GateUpLinear, Linear, MergedLinear
from pergola.models.loader import Model
from pergola.outputs.heads import HEAD_TASKS
from pergola.text.rerank import AnswerIds


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, dim] -> [T, dim]
        return rms_norm(x, self.weight, self.eps)


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


def apply_rope(q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D] where no q/k norm precedes it in the kernel (Qwen2,
    ModernBERT; Gemma3 after its own norms): one kernel, in place on CUDA (pergola.layers.fused.rope_qk)."""
    return rope_qk(q, k, rope.cos, rope.sin, positions)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = cfg.get("rms_norm_eps", 1e-6)
        qwen2 = cfg.get("model_type") == "qwen2"  # q/k/v biases, no q/k norm
        bias = cfg.get("attention_bias", False)
        self.qkv_proj = MergedLinear(h, [self.q_size, self.kv_size, self.kv_size], bias=bias or qwen2)  # q | k | v
        self.o_proj = Linear(self.q_size, h, bias=bias)  # no bias (Qwen2, Qwen3), so Triton tiles may serve it
        self.qk_norm = not qwen2
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps)  # per head, before RoPE
            self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], already normalised, or the raw residual stream when `pending`
        residual: torch.Tensor,  # [T, hidden] residual stream; the o projection is added to it in place
        positions: torch.Tensor,  # [T]
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        attn: AttentionBackend,
        pending: PendingNorm | None = None,  # the input norm, folded into qkv_proj's weight
        rows: torch.Tensor | None = None,  # [B] pooled tokens: the output holds these rows only, [B, hidden]
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) * D]
        if self.qk_norm:  # q/k RMSNorm + RoPE in one kernel, in place; q, k, v are views into qkv.
            q, k, v = qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, rope.cos, rope.sin, positions,
                                   self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm.eps, pending)
        else:
            q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            q, k = apply_rope(q, k, rope, positions)
        if rows is not None:  # every token's keys and values, the pooled rows' queries
            out = attend_rows(q[rows], k, v, meta.cu_seqlens, meta.max_seqlen)  # [B, Hq, D]
            return self.o_proj(out.reshape(rows.shape[0], self.q_size), residual[rows])
        return self.o_proj(attn(q, k, v, meta).reshape(t, self.q_size), residual)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_up_proj = GateUpLinear(h, inter)  # fused gate | up, + SiLU * mul
        self.down_proj = Linear(inter, h)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, pending: PendingNorm | None = None) -> torch.Tensor:
        # x [T, hidden] -> silu(gate) * up [T, I] (one kernel where measured faster) -> down,
        # added in place to the residual stream [T, hidden], which is returned.
        # pending: x is the raw stream, the post-attention norm folded into gate_up's weight.
        return self.down_proj(self.gate_up_proj(x, pending), residual)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.folded = False  # the two norms' gains live in qkv_proj's and gate_up_proj's weights (fold_norms)

    def fold_norms(self) -> None:
        """RMSNorm(x) @ W^T = diag(1/rms(x)) x @ (W diag(g))^T: fold each norm's gain g into the
        projection after it (fp32 product, one rounding), once, after loading. The layer then
        runs no norm kernel: the kernels after the two matmuls apply 1/rms (PendingNorm)."""
        for norm, proj in ((self.input_layernorm, self.self_attn.qkv_proj), (self.post_attention_layernorm,
                                                                             self.mlp.gate_up_proj)):
            w = proj.weight.data
            w.copy_(w.float() * norm.weight.float()[None, :])
            norm.weight.data.fill_(1.0)  # what is left of the norm: 1/rms, no gain
        self.folded = True

    def forward(
        self, residual: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, meta: AttentionMetadata,
        attn: AttentionBackend, rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Residual stream [T, hidden] -> the same tensor, updated in place by this layer; with
        `rows` ([B], the last layer of a row-pooled step) a new [B, hidden] of those rows.

        The o and down projections add their products to the stream in their matmul epilogue
        (`linear(..., residual)`), so each RMSNorm reads one [T, hidden] tensor and writes one:
        half the bytes of a separate add + norm, which HBM-bound kernels pay for in time.
        Folded (`fold_norms`), the q/k/v and gate/up matmuls read the stream itself and no norm runs.
        """
        if self.folded:
            attn_norm, mlp_norm = self.input_layernorm, self.post_attention_layernorm
            residual = self.self_attn(residual, residual, positions, rope, meta, attn,
                                      PendingNorm(residual, attn_norm.eps), rows)
            return self.mlp(residual, residual, PendingNorm(residual, mlp_norm.eps))
        residual = self.self_attn(self.input_layernorm(residual), residual, positions, rope, meta, attn,
                                  rows=rows)
        return self.mlp(self.post_attention_layernorm(residual), residual)


def _rope_theta(cfg: dict[str, Any]) -> float:
    """rope_theta from a transformers 4 (`rope_theta`) or 5 (`rope_parameters`) config."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelFolderError(f"{cfg.get('model_type')} with rope type {rope_type!r} is not supported "
                               "(only the default RoPE)")
    return float(params.get("rope_theta") or cfg.get("rope_theta", 10000.0))


def _rows_loader(rows: list[int]) -> Callable[..., None]:
    """A weight_loader that keeps `rows` of the checkpoint tensor (a [vocab, hidden] lm_head)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        param.data.copy_(loaded[rows])

    return load


class Qwen3Model(Model):
    """Returns the last hidden states [num_tokens, hidden] (after the final norm) of a ragged batch."""

    # checkpoint name -> (fused parameter, shard index)
    packed_modules_mapping = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    checkpoint_prefixes = ("model.",)  # Qwen3ForCausalLM checkpoints; lm_head serves a reranker's score only

    def __init__(self, cfg: dict[str, Any], causal: bool = True, task: str = "embed",
                 answer_ids: AnswerIds | None = None) -> None:
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
        self.rotary_emb = RotaryEmbedding(head_dim(cfg), cfg["max_position_embeddings"], _rope_theta(cfg))
        self.score_head: Linear | None = None
        if task in HEAD_TASKS and sequence_classification(cfg):
            # Qwen2/Qwen3ForSequenceClassification: `score`, a Linear without bias over the last
            # token's final-norm state -> [num_labels] logits (checkpoint name "score.weight").
            self.score_head = Linear(cfg["hidden_size"], len(cfg.get("id2label") or {0: "LABEL_0"}), bias=False)
            self.extra_targets = {"score.weight": "score_head.weight"}
        elif task == "rerank":
            if answer_ids is None:
                raise ModelFolderError("a causal LM reranker needs the token ids of its answers (no, yes)")
            # Qwen3-Reranker, mxbai-rerank-v2: only the lm_head rows of the two answers are ever
            # needed, [2, hidden]: the score never projects a position onto the 151k-token
            # vocabulary. They are read from lm_head, or from the embeddings when the two are tied.
            self.score_weight = nn.Parameter(torch.empty(2, cfg["hidden_size"]))
            self.score_weight.weight_loader = _rows_loader(list(answer_ids))
            source = "embed_tokens.weight" if cfg.get("tie_word_embeddings", False) else "lm_head.weight"
            self.extra_targets = {source: "score_weight"}
        elif task != "embed":
            raise ModelFolderError(f"{cfg.get('model_type')} serves {task} from a ForSequenceClassification head only")

    def score(self, last_states: torch.Tensor) -> torch.Tensor:
        """[B, hidden] fp32 last-token states -> logits [B, num_labels] fp32: the `score` layer's
        (ForSequenceClassification), or a causal LM's [B, 1] logit(yes) - logit(no), whose sigmoid is
        P(yes) = softmax([no, yes] logits)[yes] (pergola.outputs.heads activates them)."""
        if self.score_head is not None:
            return self.score_head(last_states.to(self.score_head.weight.dtype)).float()
        logits = (last_states.to(self.score_weight.dtype) @ self.score_weight.t()).float()  # [B, 2]
        return logits[:, 1:2] - logits[:, 0:1]

    def post_load(self) -> None:
        self.rotary_emb.fill()

    def takes_rows(self, pooling: str) -> bool:
        # A causal model's last token sees its whole sequence, as attend_rows computes; its first does not.
        return pooling == "last" or not self.causal

    def fold_norms(self) -> bool:
        """Fold every layer's two RMSNorm gains into the projections after them (Qwen3DecoderLayer.
        fold_norms): 2 fewer kernels per layer (perf/results/2026-12-06-dee4f3a/NOTES.md). Qwen2
        (no q/k norm kernel to carry v's scale, biases on q/k/v) keeps its norms. -> whether it folded."""
        if not all(layer.self_attn.qk_norm and layer.self_attn.qkv_proj.bias is None for layer in self.layers):
            return False
        for layer in self.layers:
            layer.fold_norms()
        return True

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] ignored (no segment embeddings)
        meta: AttentionMetadata,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,  # [B]: return only these rows' states (Model.takes_rows)
    ) -> torch.Tensor:
        if meta.causal != self.causal:
            raise ValueError(f"attention metadata says causal={meta.causal}, the model was built causal={self.causal}")
        residual = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor the layers update in place
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            residual = layer(residual, positions, self.rotary_emb, meta, attn, rows if i == last else None)
        return self.norm(residual)
