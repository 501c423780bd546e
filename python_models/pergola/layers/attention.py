"""Ragged attention: all sequences concatenated, `cu_seqlens` offsets, no padding in the model.

Every kernel is an `AttentionBackend`: `backend(q, k, v, meta) -> out`, with
q: [num_tokens, num_heads, head_dim], k/v: [num_tokens, num_kv_heads, head_dim]. The metadata is an
explicit argument (not a module-global context), built once per step; a backend that plans on the
host (FlashInfer) does so once per step in `plan()`, and its plan travels in `meta.plan`.
`BACKENDS` is the one registry of names: `make_backend` builds from it and the start-up probe
takes its candidates from it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pergola.layers.fused import HAVE_TRITON


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32, on the model's device
    max_seqlen: int  # longest sequence of the batch
    causal: bool
    # For padded fallbacks (SDPA): position of each token in a [num_seqs * max_seqlen] grid.
    pad_index: torch.Tensor | None = None  # [num_tokens] int64
    key_mask: torch.Tensor | None = None  # [num_seqs, 1, 1, max_seqlen] bool, True = real token
    plan: object | None = None  # what the step's backend.plan() returned (FlashInfer: the wrapper to run)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @classmethod
    def build(cls, lengths: list[int], device: torch.device, causal: bool, padded: bool) -> AttentionMetadata:
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


class AttentionBackend(abc.ABC):
    """One ragged-attention kernel: all that the runner, the probe and the benchmarks use of it.

    A step: `plan()` once on the host, its result stored in `meta.plan`, then one call per layer.
    Capabilities, declared per class:
      needs_padding: the kernel reads meta.pad_index / meta.key_mask (built by
        `AttentionMetadata.build(padded=True)`); the runner then builds each step's tensors itself,
        without static buffers or CUDA graphs.
      needs_plan: `plan()` does host work and `__call__` needs its result in `meta.plan`.
      graph_safe: a call captured in a CUDA graph stays valid for every later step of the graph's
        key (no host reads of step data; a plan, if any, re-planned in place).
    """

    name: ClassVar[str]  # the value of the attention_backend option
    needs_padding: ClassVar[bool] = False
    needs_plan: ClassVar[bool] = False
    graph_safe: ClassVar[bool] = False

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def plan(self, cu_seqlens_host: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             causal: bool, graph_key: tuple[int, int] | None = None) -> object | None:
        """The host-side schedule of one step, for `meta.plan`; None for kernels that plan nothing.

        cu_seqlens_host: [num_seqs + 1] int32 on the CPU, the step's meta.cu_seqlens.
        graph_key: the (seqs, tokens) key of the CUDA graph the step runs in, None for an eager step.
        A captured graph keeps the plan of its capture, so every later step of that key must get
        the same plan object, re-planned in place.
        """
        return None

    @abc.abstractmethod
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (views into the fused qkv projection) -> [T, Hq, D]."""


class SdpaAttention(AttentionBackend):
    """Pads into [num_seqs, heads, max_seqlen, head_dim] and calls SDPA: the CPU path.

    Padding only exists inside attention; dense layers stay on flat tokens. Padded key columns
    are masked, so a sequence's result does not depend on its batch neighbours. Not graph-safe:
    the padded grid's shape follows each step's longest sequence.
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


class TorchFlashAttention(AttentionBackend):
    """PyTorch's built-in FlashAttention-2 varlen kernel (CUDA, fp16/bf16): no extra package.

    Graph-safe: cu_seqlens is read on the device, and inside a graph max_seqlen is the bucket's
    token count, a bound for any step of the bucket.
    """

    name = "torch_flash"
    graph_safe = True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._forward(q, k, v, meta)

    @staticmethod
    def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 **window: int) -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            q, k, v, meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen,
            0.0, meta.causal, False, **window,
        )[0]

    # Whether this PyTorch's kernel takes a window (its schema names window_size_left).
    HAS_WINDOW: ClassVar[bool] = "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)

    @staticmethod
    def runs(q: torch.Tensor) -> bool:
        """Whether the kernel runs `q`'s step: CUDA, fp16/bf16, head_dim <= 256, sm80 or later."""
        return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
                and torch.cuda.get_device_capability(q.device)[0] >= 8)

    @classmethod
    def takes(cls, q: torch.Tensor) -> bool:
        """Whether the windowed kernel runs `q`'s step: `runs(q)`, in a PyTorch whose kernel takes a window."""
        return cls.HAS_WINDOW and cls.runs(q)

    @staticmethod
    def windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                 window: int) -> torch.Tensor:
        """Sliding-window attention on the ragged tokens: keys with |q - k| < window (causal:
        0 <= q - k < window). FlashAttention's window is inclusive, (left, right) = (window - 1,
        window - 1), and its tiles outside the band are skipped, so the cost grows with
        tokens x window instead of tokens x sequence length (models/padded.py's BandAttention
        uses it where `takes(q)`). GQA: k/v may have fewer heads. Graph-safe as __call__."""
        return TorchFlashAttention._forward(q, k, v, meta, window_size_left=window - 1,
                                            window_size_right=0 if meta.causal else window - 1)


class FlashAttention4(AttentionBackend):
    """FlashAttention-4 (PyPI `flash-attn-4`, CuTe DSL, module `flash_attn.cute`): varlen forward.

    On Hopper (4.0.0b36, its sm90 kernel FlashAttentionForwardSm90) it matches PyTorch's FA2
    eagerly and inside graphs (tests/test_gpu.py); replayed in a graph it is the fastest kernel
    measured at one long text and close to FlashInfer's FA3 elsewhere, while launched eagerly it
    pays host work on every call (perf/results/2026-12-03-a4c7de7/NOTES.md).
    `flash_attn_varlen_func` takes cu_seqlens on the device and max_seqlen as Python ints and reads
    no tensor on the host in the forward, so the call is graph-safe once its kernel is compiled; it
    returns (out, lse), lse None unless asked for. Kernels are JIT-compiled per variant on first use
    (the compile key includes tile choices that depend on max_seqlen, e.g. whether it exceeds one
    128-row tile), so a graph key's eager warm-up compiles before its capture, while eager steps may
    meet a new variant mid-serving. `FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1` (read at import)
    keeps compiled kernels on disk across restarts.
    """

    name = "flash_attn4"
    graph_safe = True
    # Forward kernels exist for 8.x-12.x in the source; the package names Hopper and Blackwell.
    SUPPORTED_MAJORS = (9, 10, 11)

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        if device.type != "cuda":
            raise ValueError("attention backend flash_attn4 needs a CUDA device")
        major, minor = torch.cuda.get_device_capability(device)
        if major not in self.SUPPORTED_MAJORS:
            raise ValueError(f"attention backend flash_attn4 needs a Hopper (sm90) or Blackwell (sm100/sm110) "
                             f"GPU; this one is sm{major}{minor}")
        from flash_attn.cute import flash_attn_varlen_func  # optional: pip install "flash-attn-4[cu13]"

        super().__init__(device, dtype)
        self._varlen = flash_attn_varlen_func

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q [T, H, D], k/v [T, Hkv, D] (GQA packed by the kernel); softmax scale defaults to D**-0.5.
        out, _ = self._varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens, cu_seqlens_k=meta.cu_seqlens,
                              max_seqlen_q=meta.max_seqlen, max_seqlen_k=meta.max_seqlen, causal=meta.causal)
        return out


class FlashInferAttention(AttentionBackend):
    """FlashInfer's ragged prefill (`fa2` or `fa3` template), eager and inside CUDA graphs.

    Planning is host work (it reads cu_seqlens on the CPU and writes a work schedule into an
    int workspace), so `plan()` runs once per step before the forward, never per layer, and
    returns the wrapper it planned, which `__call__` runs from `meta.plan`.
    Eager steps share one wrapper that plans any batch. Each graph key (seqs, tokens) gets its
    own wrapper in FlashInfer's CUDA-graph mode: fixed indptr buffers, a grid sized for the
    key's worst case, and a schedule re-planned into the same addresses before every replay,
    which is what makes the captured kernels valid for any later step of that bucket.
    Each CUDA stream that plans gets its own workspace (split-kv partials) and wrappers: kernels of
    one stream never overlap, but the queries' stream runs beside the bulk one (engine/runner.py).
    Kernels are JIT-compiled on first use (tens of seconds a module) unless a prebuilt module is
    installed (`scripts/gpu_bundle.py --with-flashinfer` ships them).
    """

    template: ClassVar[str]  # FlashInfer's prefill backend: "fa2" or "fa3"
    needs_plan = True
    graph_safe = True

    # The float workspace holds split-kv partials: FA2 with 16 heads of 64 (bge-m3's shape) asked
    # for 149 MiB on a probe step and was dropped (perf/results/2026-12-05-8eb77c5/pytest_archs.log).
    WORKSPACE_MB = 256

    def __init__(self, device: torch.device, dtype: torch.dtype, workspace_mb: int = WORKSPACE_MB) -> None:
        if device.type != "cuda":
            raise ValueError(f"attention backend {self.name} needs a CUDA device")
        import flashinfer  # optional dependency: pip install flashinfer-python

        super().__init__(device, dtype)
        self._flashinfer = flashinfer
        self._workspace_bytes = workspace_mb << 20
        # stream -> its workspace; (stream, graph key or None for eager steps) -> wrapper
        self._workspaces: dict[int, torch.Tensor] = {}
        self._wrappers: dict[tuple[int, tuple[int, int] | None], object] = {}
        self._planned: dict[int, tuple] = {}  # id(wrapper) -> what it was last planned for
        self._copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan's upload
        self._wrapper(None)  # the default stream's workspace, allocated while the model loads

    @property
    def graphed(self) -> list[object]:
        """The graph keys' wrappers, of every stream (tests count them)."""
        return [w for (_, key), w in self._wrappers.items() if key is not None]

    def _wrapper(self, graph_key: tuple[int, int] | None):
        """The current stream's wrapper for `graph_key` (None: eager steps), made on first use."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        wrapper = self._wrappers.get((stream, graph_key))
        if wrapper is not None:
            return wrapper
        workspace = self._workspaces.get(stream)
        if workspace is None:
            workspace = self._workspaces[stream] = torch.zeros(self._workspace_bytes, dtype=torch.uint8,
                                                               device=self.device)
        make = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper
        if graph_key is None:
            wrapper = make(workspace, "NHD", backend=self.template)
        else:
            qo = torch.zeros(graph_key[0] + 1, dtype=torch.int32, device=self.device)
            wrapper = make(workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo,
                           kv_indptr_buf=torch.zeros_like(qo), backend=self.template)
        self._wrappers[(stream, graph_key)] = wrapper
        return wrapper

    def plan(self, cu_seqlens_host: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
             causal: bool, graph_key: tuple[int, int] | None = None) -> object:
        """Schedule the next step on the current stream; -> the wrapper to run it: the stream's
        eager one, or its own for `graph_key`."""
        wrapper = self._wrapper(graph_key)
        key = (tuple(cu_seqlens_host.tolist()), num_heads, num_kv_heads, head_dim, causal)
        if self._planned.get(id(wrapper)) == key:
            return wrapper
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
        return wrapper

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.plan is None:
            raise ValueError(f"attention backend {self.name} runs a planned step: set meta.plan = backend.plan(...)")
        return meta.plan.run(q, k, v)


class FlashInferFA2(FlashInferAttention):
    name = "flashinfer_fa2"
    template = "fa2"


class FlashInferFA3(FlashInferAttention):
    name = "flashinfer_fa3"
    template = "fa3"  # Hopper only


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
    """One query row per sequence against all of that sequence's keys: q [S, Hq, D], k/v [T, Hkv, D],
    cu_seqlens [S + 1] int32 -> [S, Hq, D]. The last layer of a CLS- or last-token-pooled model
    needs no other row (pergola.models.loader.Model.forward's `rows`); the row sees its whole
    sequence, as the last token does under a causal mask. Graph-safe: no host reads.

    CUDA in half precision: PyTorch's FlashAttention-2 varlen kernel with one query per sequence.
    Elsewhere (the CPU, FP32): scores over every token of the step, masked to the row's sequence,
    in fp32; [S, Hq, T] is small beside the layer it replaces, and GQA's heads share their keys
    through a view, not a copy.
    """
    if TorchFlashAttention.runs(q):
        cu_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_seqlens, 1, max_seqlen, 0.0, False,
                                                       False)[0]
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(s, hkv, hq // hkv, d)  # [S, Hkv, G, D]: GQA, key/value head j serves G query heads
    scores = torch.einsum("sjgd,tjd->sjgt", qg, k.float()) * d ** -0.5  # [S, Hkv, G, T]
    t = torch.arange(k.shape[0], device=q.device)
    own = (t[None, :] >= cu_seqlens[:-1, None]) & (t[None, :] < cu_seqlens[1:, None])  # [S, T]
    scores = scores.masked_fill(~own[:, None, None, :], torch.finfo(torch.float32).min)
    out = torch.einsum("sjgt,tjd->sjgd", scores.softmax(-1), v.float())
    return out.reshape(s, hq, d).to(q.dtype)


def _make_triton(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    from pergola.layers.triton_attention import TritonAttention  # that module imports this one

    return TritonAttention(device, dtype)


# --- which backends "auto"'s start-up probe times (pergola.layers.attention_probe) ------------
def flashinfer_ready(template: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Is FlashInfer importable with its `template` prefill module already built (AOT or JIT cache)?

    Compiling on first use takes 20-70 s, which a start-up must not pay silently.
    """
    from pergola.layers.flashinfer_modules import prefill_spec

    try:
        if template == "fa3" and torch.cuda.get_device_capability()[0] != 9:
            return False  # the FA3 template is Hopper-only
        return bool(prefill_spec(template, head_dim, dtype).is_compiled)
    except Exception:  # noqa: BLE001 - no GPU, FlashInfer not installed or without its dependencies, an
        return False  # API change: none of them may stop the model from loading


def fa4_ready(opt_in: bool) -> bool:
    """Did the config opt in (`probe_fa4`), does `flash_attn.cute` import, does this GPU have its kernels?"""
    if not opt_in:
        return False
    if torch.cuda.get_device_capability()[0] not in FlashAttention4.SUPPORTED_MAJORS:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its CuTe DSL libraries are missing
        return False
    return True


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: how to build it, and whether the start-up probe times it here."""

    make: Callable[[torch.device, torch.dtype], AttentionBackend]
    # (head_dim, dtype, probe_fa4) -> is it a probe candidate on this machine?
    probe_candidate: Callable[[int, torch.dtype, bool], bool] = lambda *_: False


# The one list of backends, in the probe's order (the first candidate is its fallback).
# pergola.config.engine.ATTENTION_BACKENDS holds the same names for a torch-free import
# (tests/test_attention_backends.py keeps them equal).
BACKENDS: dict[str, BackendEntry] = {
    "sdpa": BackendEntry(SdpaAttention),  # the CPU and FP32 path; padded, so never timed by the probe
    "torch_flash": BackendEntry(TorchFlashAttention, lambda *_: True),
    # pergola's own kernel for short steps (pergola.layers.triton_attention)
    "triton": BackendEntry(_make_triton, lambda *_: HAVE_TRITON and torch.cuda.is_available()),
    "flashinfer_fa2": BackendEntry(FlashInferFA2, lambda head_dim, dtype, probe_fa4:
                                   flashinfer_ready("fa2", head_dim, dtype)),
    "flashinfer_fa3": BackendEntry(FlashInferFA3, lambda head_dim, dtype, probe_fa4:
                                   flashinfer_ready("fa3", head_dim, dtype)),
    "flash_attn4": BackendEntry(FlashAttention4, lambda head_dim, dtype, probe_fa4: fa4_ready(probe_fa4)),
}


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Build a backend: 'auto' is FA2 varlen on CUDA in half precision, padded SDPA otherwise."""
    if name == "auto":
        name = "torch_flash" if device.type == "cuda" and dtype != torch.float32 else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available here; choose from {['auto', *BACKENDS]}")
    return BACKENDS[name].make(device, dtype)
