"""Pooling on device (ragged) and the per-request post-processing on host."""

from __future__ import annotations

import numpy as np
import torch


def pool(
    hidden: torch.Tensor,  # [T, H] last hidden states
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    seq_ids: torch.Tensor,  # [T] int64, sequence of each token
    mode: str,
    token_weights: torch.Tensor | None = None,  # [T] 1.0 for pooled tokens (mean), None = all
) -> torch.Tensor:
    """-> [B, H] float32. Mean pooling accumulates in fp32 (BF16 sums lose digits fast).

    A CUDA-graph bucket pads the batch with empty sequences that start at T: their CLS / last
    index is clamped into [0, T) (their rows are never read), since an index of T is a
    device-side assert on the GPU.
    """
    if mode in ("cls", "last"):
        index = cu_seqlens[:-1].long() if mode == "cls" else cu_seqlens[1:].long() - 1
        return hidden[index.clamp(0, hidden.shape[0] - 1)].float()
    h = hidden.float()
    num_seqs = cu_seqlens.numel() - 1
    if token_weights is None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).float().unsqueeze(1)
    else:
        h = h * token_weights.unsqueeze(1)
        counts = torch.zeros(num_seqs, 1, device=h.device).index_add_(0, seq_ids, token_weights.unsqueeze(1))
    sums = torch.zeros(num_seqs, h.shape[1], device=h.device, dtype=torch.float32).index_add_(0, seq_ids, h)
    return sums / counts.clamp_min(1e-9)


def finish(embeddings: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """Matryoshka truncation, then L2 normalisation of what is left: [n, H] -> [n, dims] fp32."""
    out = embeddings[:, :dimensions] if dimensions else embeddings
    out = np.ascontiguousarray(out, dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.maximum(norms, 1e-12)
    return out
