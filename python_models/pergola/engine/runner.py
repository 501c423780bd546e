"""ModelRunner: owns the model, its device tensors and the attention backend; runs one step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pergola.config import EngineConfig
from pergola.engine.lazy import LazyTensor
from pergola.hf_folder import ModelSpec
from pergola.layers.attention import AttentionMetadata, make_backend
from pergola.models import build_model
from pergola.pooling import pool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, 0.. within each sequence
    token_types: torch.Tensor  # [T] int64
    seq_ids: torch.Tensor  # [T] int64, sequence index of each token (mean pooling)
    token_weights: torch.Tensor | None  # [T] fp32, 0 for prompt tokens that pooling skips
    meta: AttentionMetadata


class ModelRunner:
    def __init__(self, spec: ModelSpec, cfg: EngineConfig, device: torch.device) -> None:
        self.spec = spec
        self.cfg = cfg
        self.device = device
        self.dtype = DTYPES[cfg.compute_dtype]
        self.model = build_model(spec, device, self.dtype)
        self.attn = make_backend(cfg.attention_backend, device, self.dtype)
        self.max_positions = int(spec.hf_config.get("max_position_embeddings", 1 << 30))
        self._host_buffers: list[torch.Tensor] = []
        self._next_buffer = 0
        if device.type == "cuda":
            # Two pinned result buffers: step N+1 fills one while step N's is read.
            shape = (cfg.max_batch_seqs, spec.hidden_size)
            self._host_buffers = [torch.empty(shape, pin_memory=True) for _ in range(2)]

    def prepare(
        self,
        input_ids: np.ndarray,  # [T] int64
        lengths: np.ndarray,  # [B] int32
        skips: np.ndarray | None = None,  # [B] leading tokens left out of mean pooling
        token_types: np.ndarray | None = None,  # [T]
    ) -> BatchInputs:
        """Host-side work for one step; runs while the previous step is on the GPU."""
        num_tokens = int(input_ids.shape[0])
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        seq_ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        positions = np.arange(num_tokens, dtype=np.int64) - starts[seq_ids]
        weights = None
        if skips is not None and skips.any():
            weights = (positions >= skips[seq_ids]).astype(np.float32)
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        types = token_types if token_types is not None else np.zeros(num_tokens, dtype=np.int64)
        meta = AttentionMetadata.build(
            lengths.tolist(), dev, causal=self.spec.causal, padded=getattr(self.attn, "needs_padding", False)
        )
        return BatchInputs(
            input_ids=put(input_ids.astype(np.int64, copy=False)),
            positions=put(positions),
            token_types=put(types.astype(np.int64, copy=False)),
            seq_ids=put(seq_ids),
            token_weights=None if weights is None else put(weights),
            meta=meta,
        )

    @torch.inference_mode()
    def forward(self, b: BatchInputs) -> torch.Tensor:
        """-> pooled [B, hidden] fp32 on the device."""
        hidden = self.model(b.input_ids, b.positions, b.token_types, b.meta, self.attn)
        return pool(hidden, b.meta.cu_seqlens, b.seq_ids, self.spec.pooling, b.token_weights)

    def step(self, b: BatchInputs) -> LazyTensor:
        """Launch forward + pooling + copy to host; returns at once on the GPU."""
        out = self.forward(b)
        if self.device.type == "cpu":
            return LazyTensor(out)
        buf = self._host_buffers[self._next_buffer]
        self._next_buffer ^= 1
        return LazyTensor(out, buf)
