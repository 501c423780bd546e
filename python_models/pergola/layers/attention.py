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


class FlashAttention4:
    """FlashAttention-4 (PyPI `flash-attn-4`, CuTe DSL, module `flash_attn.cute`): varlen forward.

    On the H200 (4.0.0b36, its sm90 kernel FlashAttentionForwardSm90) it matches PyTorch's FA2
    eagerly and inside graphs (tests/test_gpu.py), and per layer call, replayed in a graph, it takes
    34 µs at one 2,048-token text and 112 µs at one of 4,096 where FlashInfer's FA3 takes 47 and
    135; at the other graph shapes the two are within 6% except 8 x 512 tokens (FA3 12% faster), and
    launched eagerly it takes ~180 µs more per call than in a graph (perf/RESULTS.md, session 7).
    `flash_attn_varlen_func` takes cu_seqlens on the device and max_seqlen as Python ints and reads
    no tensor on the host in the forward, so the call is graph-safe once its kernel is compiled; it
    returns (out, lse), lse None unless asked for. Kernels are JIT-compiled per variant on first use
    (the compile key includes tile choices that depend on max_seqlen, e.g. whether it exceeds one
    128-row tile), so a graph key's eager warm-up compiles before its capture, while eager steps may
    meet a new variant mid-serving. `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1` (read at import)
    keeps compiled kernels on disk across restarts.
    """

    name = "flash_attn4"
    needs_padding = False
    graph_safe = True
    # Forward kernels exist for 8.x-12.x in the source; the package names Hopper and Blackwell.
    SUPPORTED_MAJORS = (9, 10, 11)

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("attention backend flash_attn4 needs a CUDA device")
        major, minor = torch.cuda.get_device_capability(device)
        if major not in self.SUPPORTED_MAJORS:
            raise ValueError(f"attention backend flash_attn4 needs a Hopper (sm90) or Blackwell (sm100/sm110) "
                             f"GPU; this one is sm{major}{minor}")
        from flash_attn.cute import flash_attn_varlen_func  # optional: pip install "flash-attn-4[cu13]"

        self._varlen = flash_attn_varlen_func

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q [T, H, D], k/v [T, Hkv, D] (GQA packed by the kernel); softmax scale defaults to D**-0.5.
        out, _ = self._varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_k=meta.cu_seqlens,
                              max_seqlen_q=meta.max_seqlen, max_seqlen_k=meta.max_seqlen, causal=meta.causal)
        return out


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "sdpa": SdpaAttention,
    "torch_flash": TorchFlashAttention,
}


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Pick a backend: 'auto' is FA2 varlen on CUDA in half precision, padded SDPA otherwise."""
    if name == "auto":
        name = "torch_flash" if device.type == "cuda" and dtype != torch.float32 else "sdpa"
    if name.startswith("flashinfer_"):
        if device.type != "cuda":
            raise ValueError(f"attention backend {name} needs a CUDA device")
        return FlashInferAttention(name.split("_", 1)[1], device, dtype)
    if name == "flash_attn4":
        return FlashAttention4(device)
    if name == "triton":
        from pergola.layers.triton_attention import TritonAttention

        return TritonAttention(device)
    if name not in BACKENDS:
        from pergola.config import ATTENTION_BACKENDS  # the one list of names

        raise ValueError(f"attention backend {name!r} is not available here; choose from {list(ATTENTION_BACKENDS)}")
    return BACKENDS[name]()


class FlashInferAttention:
    """FlashInfer's ragged prefill (`fa2` or `fa3` template), eager and inside CUDA graphs.

    Planning is host work (it reads cu_seqlens on the CPU and writes a work schedule into an
    int workspace), so `plan()` runs once per step before the forward, never per layer.
    Eager steps share one wrapper that plans any batch. Each graph key (seqs, tokens) gets its
    own wrapper in FlashInfer's CUDA-graph mode: fixed indptr buffers, a grid sized for the
    key's worst case, and a schedule re-planned into the same addresses before every replay,
    which is what makes the captured kernels valid for any later step of that bucket.
    The float workspace (split-kv partials) is shared: kernels of one stream never overlap.
    Kernels are JIT-compiled on first use (fa2 ~21 s, fa3 ~66 s on the H200) unless a
    prebuilt module is installed (`scripts/gpu_bundle.py --with-flashinfer` ships them).
    """

    needs_padding = False
    needs_plan = True
    graph_safe = True

    def __init__(self, backend: str, device: torch.device, dtype: torch.dtype, workspace_mb: int = 128) -> None:
        import flashinfer  # optional dependency: pip install flashinfer-python

        self._flashinfer = flashinfer
        self.name = f"flashinfer_{backend}"
        self.backend, self.device, self.dtype = backend, device, dtype
        self.workspace = torch.zeros(workspace_mb << 20, dtype=torch.uint8, device=device)
        self.eager = self._wrapper(None)
        self.graphed: dict[tuple[int, int], object] = {}
        self.active = self.eager
        self._planned: dict[int, tuple] = {}  # id(wrapper) -> what it was last planned for
        self._copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's upload

    def _wrapper(self, num_seqs: int | None):
        make = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper
        if num_seqs is None:
            return make(self.workspace, "NHD", backend=self.backend)
        qo = torch.zeros(num_seqs + 1, dtype=torch.int32, device=self.device)
        return make(self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo,
                    kv_indptr_buf=torch.zeros_like(qo), backend=self.backend)

    def plan(self, cu_seqlens_host: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             causal: bool, graph_key: tuple[int, int] | None = None) -> None:
        """Schedule the next step; `graph_key` selects the wrapper a graph of that key replays."""
        if graph_key is None:
            wrapper = self.eager
        else:
            wrapper = self.graphed.get(graph_key)
            if wrapper is None:
                wrapper = self.graphed[graph_key] = self._wrapper(graph_key[0])
        self.active = wrapper
        key = (tuple(cu_seqlens_host.tolist()), num_heads, num_kv_heads, head_dim, causal)
        if self._planned.get(id(wrapper)) == key:
            return
        # plan() fills one pinned buffer and uploads it asynchronously: the previous upload
        # from that buffer must have run before it is overwritten (steps are pipelined).
        copied = self._copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        wrapper.plan(cu_seqlens_host, cu_seqlens_host, num_heads, num_kv_heads, head_dim,
                     causal=causal, q_data_type=self.dtype, kv_data_type=self.dtype)
        event = self._copied.setdefault(id(wrapper), torch.cuda.Event())
        event.record()
        self._planned[id(wrapper)] = key

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.active.run(q, k, v)
