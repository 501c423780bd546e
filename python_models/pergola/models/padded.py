"""Attention outside the ragged kernels: a step padded into a [num_seqs, L] grid for SDPA with a
mask (MPNet's relative position bias, sliding windows of Gemma3 and ModernBERT).

Everything is built on the device from cu_seqlens and the tokens' positions (no host sync), so it
runs inside a CUDA graph; L is the step's longest sequence, bounded by the position table, since
in a graph step the longest sequence is unknown (t tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pergola.layers.attention import AttentionMetadata, TorchFlashAttention
from pergola.layers.triton_attention import ragged_attention, triton_window_takes


class PaddedLayout:
    """Where each ragged token sits in a [num_seqs, L] grid, and which keys are real, for one step.

    Built on the device from cu_seqlens and the tokens' positions (no host sync). A CUDA-graph
    bucket's padding sequence may be longer than L: its tokens all land in column 0 (duplicates;
    its rows are never read)."""

    def __init__(self, meta: AttentionMetadata, positions: torch.Tensor, longest: int) -> None:
        cu = meta.cu_seqlens.long()
        num_seqs, t = cu.numel() - 1, positions.shape[0]
        tokens = torch.arange(t, device=positions.device)
        seq = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=num_seqs - 1)  # [T]
        column = torch.where(positions < longest, positions, torch.zeros_like(positions))
        self.num_seqs, self.longest = num_seqs, longest
        self.index = seq * longest + column  # [T] into the flattened [num_seqs * L] grid
        lengths = cu[1:] - cu[:-1]
        cols = torch.arange(longest, device=positions.device)
        self.key_mask = (cols[None, :] < lengths[:, None]).view(num_seqs, 1, 1, longest)

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        grid = x.new_zeros(self.num_seqs * self.longest, x.shape[1], x.shape[2])
        grid.index_copy_(0, self.index, x)
        return grid.view(self.num_seqs, self.longest, x.shape[1], x.shape[2]).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, L, D] -> [T, H, D]
        return x.transpose(1, 2).reshape(self.num_seqs * self.longest, x.shape[1], x.shape[3])[self.index]


class BandAttention:
    """Sliding-window attention of one step: keys with |q - k| < window (causal: 0 <= q - k <
    window). On a GPU, pergola's Triton ragged kernel walking only each block's band of keys
    where it is the faster (head_dim 64: ModernBERT) and FlashAttention-2's windowed varlen kernel
    otherwise (Gemma3's 256), both costing ~ tokens x window (layers/triton_attention.py,
    WINDOW_MAX_HEAD_DIM); elsewhere a padded grid (SDPA with a band mask, cost ~ tokens x longest
    sequence).
    Made per forward; the layout and the mask are built at the first sliding layer that needs
    them and shared by the others."""

    def __init__(self, meta: AttentionMetadata, positions: torch.Tensor, longest: int) -> None:
        self.meta, self.positions = meta, positions
        self.longest = min(meta.max_seqlen, longest)  # longest: the position table, a bound in graph steps
        self._built: tuple[PaddedLayout, torch.Tensor] | None = None
        self._window = 0

    def _build(self, window: int) -> tuple[PaddedLayout, torch.Tensor]:
        if self._built is None or self._window != window:
            layout = PaddedLayout(self.meta, self.positions, self.longest)
            cols = torch.arange(layout.longest, device=self.positions.device)
            distance = cols[:, None] - cols[None, :]  # [L, L] query - key
            band = (distance >= 0) & (distance < window) if self.meta.causal else distance.abs() < window
            self._built, self._window = (layout, band[None, None] & layout.key_mask), window  # mask [B, 1, L, L]
        return self._built

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        if triton_window_takes(q):
            return ragged_attention(q, k, v, self.meta.cu_seqlens, self.meta.causal, window=window)
        if TorchFlashAttention.takes(q):
            return TorchFlashAttention.windowed(q, k, v, self.meta, window)
        layout, mask = self._build(window)
        if q.shape[1] != k.shape[1]:
            # Key/value heads repeated for each query head (GQA), so that any fused SDPA kernel that
            # takes a mask qualifies: not all of them take enable_gqa, and the math fallback holds
            # [B, H, L, L] fp32 scores.
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(layout.pad(q), layout.pad(k), layout.pad(v), attn_mask=mask)
        return layout.unpad(out)
