"""Ragged attention: all sequences concatenated, `cu_seqlens` offsets, no padding in the model.

Backends share one call signature, `backend(q, k, v, meta) -> out`, with
q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim].
The metadata is an explicit argument (not a module-global context), built once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    max_seqlen: int  # longest sequence of the batch
    causal: bool
    # For padded fallbacks (SDPA): position of each token in a [num_seqs * max_seqlen] grid.
    pad_index: torch.Tensor | None = None  # [num_tokens] int64
    key_mask: torch.Tensor | None = None  # [num_seqs, 1, 1, max_seqlen] bool, True = real token

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @classmethod
    def build(cls, lengths: list[int], device: torch.device, causal: bool, padded: bool) -> "AttentionMetadata":
        lens = torch.tensor(lengths, dtype=torch.int32)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        max_len = max(lengths)
        meta = cls(cu_seqlens=cu.to(device, non_blocking=True), max_seqlen=max_len, causal=causal)
        if padded:
            seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lens.long())
            offsets = torch.arange(int(cu[-1])) - cu[:-1].long()[seq_ids]
            meta.pad_index = (seq_ids * max_len + offsets).to(device)
            cols = torch.arange(max_len)
            meta.key_mask = (cols[None, :] < lens[:, None]).view(len(lengths), 1, 1, max_len).to(device)
        return meta


class AttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor: ...


class SdpaAttention:
    """Pads into [num_seqs, heads, max_seqlen, head_dim] and calls SDPA: the CPU path.

    Padding only exists inside attention; dense layers stay on flat tokens. Padded key columns
    are masked, so a sequence's result does not depend on its batch neighbours.
    """

    name = "sdpa"
    needs_padding = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.pad_index is not None and meta.key_mask is not None
        b, length = meta.num_seqs, meta.max_seqlen

        def pad(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            grid = x.new_zeros(b * length, x.shape[1], x.shape[2])
            grid.index_copy_(0, meta.pad_index, x)
            return grid.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)

        mask = meta.key_mask
        if meta.causal:
            mask = mask & torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            pad(q), pad(k), pad(v), attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
        )
        out = out.transpose(1, 2).reshape(b * length, q.shape[1], q.shape[2])
        return out.index_select(0, meta.pad_index)


class TorchFlashAttention:
    """PyTorch's built-in FlashAttention-2 varlen kernel (CUDA, fp16/bf16): no extra package."""

    name = "torch_flash"
    needs_padding = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen,
            0.0, meta.causal, False,
        )[0]
        return out


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": SdpaAttention,
    "torch_flash": TorchFlashAttention,
}


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Pick a backend: 'auto' is FA2 varlen on CUDA in half precision, padded SDPA otherwise."""
    if name == "auto":
        name = "torch_flash" if device.type == "cuda" and dtype != torch.float32 else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; choose from {sorted(BACKENDS)}")
    return BACKENDS[name]()
