"""Start-up probe: time each available ragged-attention kernel on this GPU for this model's heads.

`attention_backend = "auto"` on a GPU runs it once per model load (well under a second): the
fastest kernel over small steps (those that CUDA graphs replay) drives the graphs, the fastest
over full token-budget steps drives eager steps above the crossover. Which kernel wins depends
on the GPU, head layout and step shape (on the H200, Qwen3 heads: PyTorch's FA2 at 1 × 512,
FlashInfer FA2 at 32 × 512, perf/RESULTS.md), hence measuring instead of a fixed table.

FlashInfer kernels that are not compiled yet are left out: compiling them on first use takes
20-70 s, which a start-up must not pay silently. Ship them prebuilt (scripts/gpu_bundle.py) or
name the backend explicitly in the config to compile it once.

FlashAttention-4 (`flash_attn4`) also compiles on first use (CuTe DSL JIT, one kernel per variant;
the probe's shapes need several), for a time not yet measured here, and has no prebuilt form:
it is timed only when `PERGOLA_PROBE_FA4=1` asks for it, and only on the GPUs it supports.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from pergola.layers.attention import AttentionBackend, AttentionMetadata, make_backend

log = logging.getLogger("pergola.attention")

# (sequences, tokens each): what graph steps look like (batch-1 queries, small batches) ...
SMALL_SHAPES = [(1, 128), (1, 512), (8, 128), (4, 512)]
# ... and what a full 16k-token step of bulk embedding looks like.
LARGE_SHAPES = [(32, 512), (4, 4096)]


@dataclass
class ProbeResult:
    graph: str  # backend for steps replayed from CUDA graphs
    eager: str  # backend for steps above the graph crossover
    backends: dict[str, AttentionBackend]  # the instances timed, reused by the runner
    micros: dict[str, dict[str, float]] = field(default_factory=dict)  # backend -> "SxL" -> µs


def flashinfer_ready(backend: str, head_dim: int, dtype: torch.dtype) -> bool:
    """Is FlashInfer importable with its `backend` prefill module already built (AOT or JIT cache)?"""
    try:
        from flashinfer.jit.attention import gen_batch_prefill_module
    except Exception:  # noqa: BLE001 - not installed, or installed without its dependencies
        return False
    if backend == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        return False  # the FA3 template is Hopper-only
    try:
        spec = gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, head_dim, head_dim,
                                        0, False, False, False)
        return bool(spec.is_compiled)
    except Exception:  # noqa: BLE001 - an API change must not stop the model from loading
        return False


def fa4_ready() -> bool:
    """Did `PERGOLA_PROBE_FA4=1` opt in, does `flash_attn.cute` import and does this GPU have its kernels?"""
    if os.environ.get("PERGOLA_PROBE_FA4", "") != "1":
        return False
    from pergola.layers.attention import FlashAttention4

    if torch.cuda.get_device_capability()[0] not in FlashAttention4.SUPPORTED_MAJORS:
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its CuTe DSL libraries are missing
        return False
    return True


def candidates(head_dim: int, dtype: torch.dtype) -> list[str]:
    names = ["torch_flash"]
    names += [f"flashinfer_{b}" for b in ("fa2", "fa3") if flashinfer_ready(b, head_dim, dtype)]
    if fa4_ready():
        names.append("flash_attn4")
    return names


def time_backend(attn: AttentionBackend, heads: int, kv_heads: int, head_dim: int, causal: bool,
                 shape: tuple[int, int], device: torch.device, dtype: torch.dtype, iters: int = 10) -> float:
    """Mean µs of one call on a ragged batch of `shape` (planning, if any, outside the timing)."""
    seqs, length = shape
    t = seqs * length
    q = torch.randn(t, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    cu_host = torch.arange(0, t + 1, length, dtype=torch.int32)
    meta = AttentionMetadata(cu_seqlens=cu_host.to(device), max_seqlen=length, causal=causal)
    if getattr(attn, "needs_plan", False):
        attn.plan(cu_host, heads, kv_heads, head_dim, causal)
    for _ in range(3):
        attn(q, k, v, meta)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        attn(q, k, v, meta)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def probe(heads: int, kv_heads: int, head_dim: int, causal: bool, device: torch.device,
          dtype: torch.dtype, names: list[str] | None = None) -> ProbeResult:
    """Time every candidate on SMALL_SHAPES and LARGE_SHAPES; pick the fastest for each group."""
    names = names or candidates(head_dim, dtype)
    if len(names) == 1:  # nothing to choose between
        return ProbeResult(names[0], names[0], {names[0]: make_backend(names[0], device, dtype)})
    backends: dict[str, AttentionBackend] = {}
    micros: dict[str, dict[str, float]] = {}
    for name in names:
        try:
            attn = make_backend(name, device, dtype)
            micros[name] = {f"{s}x{n}": time_backend(attn, heads, kv_heads, head_dim, causal, (s, n), device, dtype)
                            for s, n in SMALL_SHAPES + LARGE_SHAPES}
            backends[name] = attn
        except Exception as e:  # noqa: BLE001 - a kernel that fails here is simply not chosen
            log.warning("attention probe: %s failed (%s: %s); not used", name, type(e).__name__, e)
    if not micros:
        return ProbeResult("torch_flash", "torch_flash", {"torch_flash": make_backend("torch_flash", device, dtype)})

    def fastest(shapes: list[tuple[int, int]]) -> str:
        return min(micros, key=lambda b: sum(micros[b][f"{s}x{n}"] for s, n in shapes))

    result = ProbeResult(fastest(SMALL_SHAPES), fastest(LARGE_SHAPES), backends, micros)
    table = "; ".join(f"{b}: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items()) for b, m in micros.items())
    log.info("attention probe (µs per layer call): %s -> graphs: %s, large eager steps: %s",
             table, result.graph, result.eager)
    return result
