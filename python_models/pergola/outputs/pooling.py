"""Pooling on device (ragged), sentence-transformers Dense modules, bge-m3's per-token heads, and
the per-request post-processing on host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pergola.config.hf_folder import TOKEN_HEADS, DenseModule, ModelFolderError, ModelSpec
from pergola.layers.linear import Linear

# Dense activations by their saved name (hf_folder.DENSE_ACTIVATIONS), None: Identity.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {
    "torch.nn.modules.linear.Identity": None,
    "torch.nn.modules.activation.Tanh": torch.tanh,
    "torch.nn.modules.activation.ReLU": torch.relu,
    "torch.nn.modules.activation.GELU": nn.functional.gelu,
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.modules.activation.SiLU": nn.functional.silu,
}


def _dense_weights(module: DenseModule) -> dict[str, torch.Tensor]:
    """linear.weight / linear.bias of a Dense folder: model.safetensors, or the pytorch_model.bin
    of older sentence-transformers saves (read with weights_only: tensors, no code)."""
    if (module.path / "model.safetensors").is_file():
        return load_file(str(module.path / "model.safetensors"))
    if (module.path / "pytorch_model.bin").is_file():
        return torch.load(module.path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelFolderError(f"{module.path}: no model.safetensors or pytorch_model.bin for this Dense module")


class DenseStack(nn.Module):
    """sentence-transformers Dense modules, [N, in] -> [N, out], in the model's dtype.

    Applied by the runner to the pooled [B, hidden] rows, as sentence-transformers does (so any
    activation goes, after any pooling); inside the step, so CUDA graphs hold it too.
    """

    def __init__(self, modules: tuple[DenseModule, ...], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.activations = [ACTIVATIONS[m.activation] for m in modules]
        for m in modules:
            weights = _dense_weights(m)
            layer = Linear(m.in_features, m.out_features, bias=m.bias).to(device=device, dtype=dtype)
            expected = {"linear.weight"} | ({"linear.bias"} if m.bias else set())
            if set(weights) != expected:
                raise ModelFolderError(f"{m.path}: Dense weights {sorted(weights)}, expected {sorted(expected)}")
            with torch.no_grad():
                layer.weight.copy_(weights["linear.weight"])
                if m.bias:
                    layer.bias.copy_(weights["linear.bias"])
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, activation in zip(self.layers, self.activations):
            x = layer(x)
            if activation is not None:
                x = activation(x)
        return x


def attach_dense(model: nn.Module, modules: tuple[DenseModule, ...], device: torch.device,
                 dtype: torch.dtype) -> None:
    """Give `model` its Dense stack (`model.dense`), which the runner applies after pooling."""
    model.dense = DenseStack(modules, device, dtype)


def _token_head(path: Path, hidden: int, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    """One head's Linear from its state dict (`weight` [out, hidden], `bias` [out]): torch's own, kept
    out of the model's projection tiles and FP8 (a few matmuls per step, in the model's dtype)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if set(state) != {"weight", "bias"} or state["weight"].ndim != 2 or state["weight"].shape[1] != hidden:
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        raise ModelFolderError(f"{path}: expected a Linear({hidden}, out) state dict (weight, bias), got {shapes}")
    layer = nn.Linear(hidden, state["weight"].shape[0], device=device, dtype=dtype)
    layer.load_state_dict(state)
    return layer


class TokenHeads(nn.Module):
    """bge-m3's heads over the last hidden states: [T, H] -> [T, width] fp32, the sparse weight in
    column 0 (when the folder has it), then the normalised ColBERT vector (when it has that)."""

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = int(spec.hf_config["hidden_size"])
        heads = {name: _token_head(spec.path / TOKEN_HEADS[name], hidden, device, dtype) for name in spec.token_heads}
        self.sparse, self.colbert = heads.get("sparse"), heads.get("colbert")
        if self.sparse is not None and self.sparse.out_features != 1:
            raise ModelFolderError(f"{spec.path / TOKEN_HEADS['sparse']}: the sparse head gives one weight per "
                                   f"token, this one {self.sparse.out_features}")
        self.width = (self.sparse is not None) + (0 if self.colbert is None else self.colbert.out_features)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        columns = []
        if self.sparse is not None:
            columns.append(torch.relu(self.sparse(hidden)).float())  # [T, 1]
        if self.colbert is not None:
            columns.append(nn.functional.normalize(self.colbert(hidden).float(), dim=-1))  # [T, D]
        return torch.cat(columns, dim=1) if len(columns) > 1 else columns[0]


ROW_POOLING = ("cls", "last")  # the pooling modes that read one token of each sequence


def pooled_rows(cu_seqlens: torch.Tensor, mode: str, num_tokens: int) -> torch.Tensor:
    """[B + 1] int32 offsets -> [B] int64: the token each sequence is pooled from (ROW_POOLING).

    A CUDA-graph bucket pads the batch with empty sequences that start at T: their CLS / last
    index is clamped into [0, T) (their rows are never read), since an index of T is a
    device-side assert on the GPU.
    """
    index = cu_seqlens[:-1].long() if mode == "cls" else cu_seqlens[1:].long() - 1
    return index.clamp(0, num_tokens - 1)


def pool(
    hidden: torch.Tensor,  # [T, H] last hidden states
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    seq_ids: torch.Tensor,  # [T] int64, sequence of each token
    mode: str,
    token_weights: torch.Tensor | None = None,  # [T] 1.0 for pooled tokens (mean), None = all
) -> torch.Tensor:
    """-> [B, H] float32. Mean pooling accumulates in fp32 (BF16 sums lose digits fast)."""
    if mode in ROW_POOLING:
        return hidden[pooled_rows(cu_seqlens, mode, hidden.shape[0])].float()
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
