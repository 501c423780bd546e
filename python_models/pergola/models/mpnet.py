"""MPNet encoder (sentence-transformers/all-mpnet-base-v2 and its fine-tunes) over flat tokens: [T, hidden].

BERT's post-norm layers with three differences, followed here as Hugging Face's `MPNetModel` has
them: no token types; positions numbered RoBERTa's way (from padding index 1 + 1); and a learned
relative position bias, [heads] per bucket of (key index - query index), shared by all layers
and added to the attention scores. Module and weight names follow HF; q/k/v are one fused matmul.

The ragged attention kernels take no additive bias, so attention here pads each step into
[num_seqs, heads, L, L] and calls SDPA with the bias as a float mask, whichever kernel the
runner chose. L is the step's longest sequence, bounded by the position table, so a CUDA-graph
step (whose longest sequence is unknown at capture) costs num_seqs * heads * L^2 mask entries with L
at most max_position_embeddings - 2 (512). A GPU kernel would need a per-head bias looked up by
bucket inside the kernel (FlexAttention's score_mod, or pergola's Triton kernel with a
[heads, buckets] table); FlashAttention and FlashInfer do not take one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pergola.config.hf_folder import head_dim, max_positions
from pergola.layers.attention import AttentionBackend, AttentionMetadata
from pergola.layers.linear import Linear, MergedLinear
from pergola.models.bert import BertLayer, roberta_positions
from pergola.models.loader import Model
from pergola.models.padded import PaddedLayout

PADDING_IDX = 1  # fixed in HF's MPNetEmbeddings, whatever the config's pad_token_id


def relative_position_bucket(relative: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """HF's `MPNetEncoder.relative_position_bucket` (T5's bidirectional buckets): half the buckets
    per direction, exact below num_buckets / 4, logarithmic up to max_distance."""
    n = -relative
    half = num_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = n.abs()
    max_exact = half // 2
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = torch.clamp(large, max=half - 1)
    return ret + torch.where(n < max_exact, n, large)


class MPNetSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads, self.head_dim = cfg["num_attention_heads"], head_dim(cfg)
        self.qkv = MergedLinear(h, [h, h, h], bias=True)  # fused q | k | v
        self.o = Linear(h, h, bias=True)

    def forward(self, x: torch.Tensor, layout: PaddedLayout, mask: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        out = F.scaled_dot_product_attention(layout.pad(q), layout.pad(k), layout.pad(v), attn_mask=mask)
        return self.o(layout.unpad(out).reshape(t, -1))


class MPNetLayer(BertLayer):
    """BERT's layer with MPNet's attention (names `attention.attn.*`, `attention.LayerNorm`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.attention = nn.Module()
        self.attention.attn = MPNetSelfAttention(cfg)
        self.attention.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, layout: PaddedLayout, mask: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.attention.LayerNorm(self.attention.attn(x, layout, mask) + x))


class MPNetModel(Model):
    """Returns the last hidden states [num_tokens, hidden] of a ragged batch."""

    packed_modules_mapping = {
        "attention.attn.q": ("attention.attn.qkv", 0),
        "attention.attn.k": ("attention.attn.qkv", 1),
        "attention.attn.v": ("attention.attn.qkv", 2),
    }
    checkpoint_prefixes = ("mpnet.",)
    causal = False

    def __init__(self, cfg: dict[str, Any], task: str = "embed") -> None:
        super().__init__()
        if task != "embed":
            raise ValueError("MPNet is served as an embedder only")
        h = cfg["hidden_size"]
        self.config = cfg
        self.longest = max_positions(cfg)  # the longest sequence the position table allows
        self.num_buckets = int(cfg.get("relative_attention_num_buckets", 32))
        self.embeddings = nn.Module()
        self.embeddings.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.embeddings.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.embeddings.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(MPNetLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.encoder.relative_attention_bias = nn.Embedding(self.num_buckets, cfg["num_attention_heads"])

    def attention_mask(self, layout: PaddedLayout, dtype: torch.dtype) -> torch.Tensor:
        """[B, H, L, L] float: the relative position bias of (key - query), -inf at padded keys."""
        cols = torch.arange(layout.longest, device=layout.index.device)
        buckets = relative_position_bucket(cols[None, :] - cols[:, None], self.num_buckets)  # [L, L]
        bias = self.encoder.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0).to(dtype)  # [1, H, L, L]
        return bias.masked_fill(~layout.key_mask, float("-inf"))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] ignored (MPNet has no segment embeddings)
        meta: AttentionMetadata,
        attn: AttentionBackend,  # unused: attention takes a bias no ragged kernel does (module docstring)
    ) -> torch.Tensor:
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(roberta_positions(input_ids, positions, PADDING_IDX))
        x = e.LayerNorm(x)
        layout = PaddedLayout(meta, positions, min(meta.max_seqlen, self.longest))
        mask = self.attention_mask(layout, x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, layout, mask)
        return x
