"""Start-up probe: time each available ragged-attention kernel on this GPU for this model's heads.

`attention_backend = "auto"` on a GPU runs it once per model load (about a second). Graph-sized
steps are timed the way they run, replayed from a CUDA graph (FlashInfer in its CUDA-graph mode),
and the fastest kernel is chosen per class of step size (up to 512, 2048 tokens and the graph
crossover): at one 128-token text FlashInfer's graph mode pays a split-KV merge kernel per layer
that PyTorch's FA2 does not, while at long steps FlashInfer's FA3 is the faster
(perf/results/2026-12-03-a4c7de7/NOTES.md). Full token-budget steps are timed eagerly, as they run,
and pick the eager kernel. Which kernel wins depends on the GPU, head layout and step shape, hence
measuring instead of a fixed table.

The candidates are the registered backends whose rule says yes here (BACKENDS in
pergola.layers.attention). FlashInfer kernels that are not compiled yet are left out: compiling
them on first use takes tens of seconds, which a start-up must not pay silently. Ship them prebuilt
(scripts/gpu_bundle.py) or name the backend explicitly in the config to compile it once.

FlashAttention-4 (`flash_attn4`) also compiles on first use (CuTe DSL JIT, one kernel per variant;
the probe's shapes need several) and has no prebuilt form: timing it makes every model load pay
that compile. It is timed only when `probe_fa4` (`--probe-fa4`) asks for it, and only on the GPUs
it supports; there it wins the graph classes that hold one long text, which is worth the compile
for long-query latency and not for short queries (perf/results/2026-12-03-a4c7de7/NOTES.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pergola.config.engine import CUDA_GRAPH_MAX_TOKENS
from pergola.layers.attention import BACKENDS, AttentionBackend, AttentionMetadata, make_backend
from pergola.layers.cudagraph import capture
from pergola.layers.fused import split_qkv

log = logging.getLogger("pergola.attention")

# (sequences, tokens each): what graph steps look like, by class of step size (total tokens) ...
GRAPH_CLASSES: dict[int, list[tuple[int, int]]] = {
    512: [(1, 128), (1, 512)],  # online queries
    2048: [(8, 128), (4, 512), (1, 2048)],  # small batches
    CUDA_GRAPH_MAX_TOKENS: [(CUDA_GRAPH_MAX_TOKENS // 512, 512), (1, CUDA_GRAPH_MAX_TOKENS)],  # up to the crossover
}
SMALL_SHAPES = [shape for shapes in GRAPH_CLASSES.values() for shape in shapes]
# ... and what a full 16k-token step of bulk embedding looks like (eager).
LARGE_SHAPES = [(32, 512), (4, 4096)]


@dataclass
class ProbeResult:
    graph_rules: list[tuple[int, str]]  # (most tokens, backend) for graph steps, increasing; the last covers the rest
    eager: str  # backend for steps above the graph crossover
    backends: dict[str, AttentionBackend]  # the instances timed, reused by the runner
    micros: dict[str, dict[str, float]] = field(default_factory=dict)  # backend -> "SxL" -> µs

    @property
    def graph(self) -> str:
        """The kernel of the smallest graph steps (batch-1 queries)."""
        return self.graph_rules[0][1]


def candidates(head_dim: int, dtype: torch.dtype, probe_fa4: bool = False) -> list[str]:
    """The registered backends timed on this machine, in registry order (torch_flash, the fallback, first)."""
    return [name for name, entry in BACKENDS.items() if entry.probe_candidate(head_dim, dtype, probe_fa4)]


def time_backend(attn: AttentionBackend, heads: int, kv_heads: int, head_dim: int, causal: bool,
                 shape: tuple[int, int], device: torch.device, dtype: torch.dtype, iters: int = 10,
                 graphed: bool = False) -> float:
    """Mean µs of one call on a ragged batch of `shape` (planning, if any, outside the timing).

    q/k/v are views into one fused qkv tensor, as the models hand them over.
    graphed: `iters` calls captured in a CUDA graph and replayed, as a graph step runs them
    (FlashInfer through its CUDA-graph-mode wrapper); launch overhead is then not counted.
    """
    seqs, length = shape
    t = seqs * length
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    cu_host = torch.arange(0, t + 1, length, dtype=torch.int32)
    plan = attn.plan(cu_host, heads, kv_heads, head_dim, causal, graph_key=(seqs, t) if graphed else None)
    meta = AttentionMetadata(cu_seqlens=cu_host.to(device), max_seqlen=length, causal=causal, plan=plan)
    q, k, v = split_qkv(qkv, heads, kv_heads, head_dim)
    call = lambda: attn(q, k, v, meta)  # noqa: E731
    for _ in range(3):
        call()
    run = lambda: [call() for _ in range(iters)]  # noqa: E731
    if graphed:
        graph = torch.cuda.CUDAGraph()
        capture(graph, run)
        run = graph.replay
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def probe(heads: int, kv_heads: int, head_dim: int, causal: bool, device: torch.device,
          dtype: torch.dtype, names: list[str] | None = None, probe_fa4: bool = False) -> ProbeResult:
    """Time every candidate on each class of graph steps (in graphs) and on LARGE_SHAPES (eager)."""
    names = names or candidates(head_dim, dtype, probe_fa4)
    last = max(GRAPH_CLASSES)
    if len(names) == 1:  # nothing to choose between
        return ProbeResult([(last, names[0])], names[0], {names[0]: make_backend(names[0], device, dtype)})
    backends: dict[str, AttentionBackend] = {}
    micros: dict[str, dict[str, float]] = {}
    for name in names:
        try:
            attn = make_backend(name, device, dtype)
            micros[name] = {
                f"{s}x{n}": time_backend(attn, heads, kv_heads, head_dim, causal, (s, n), device, dtype,
                                         graphed=(s, n) in SMALL_SHAPES)
                for s, n in SMALL_SHAPES + LARGE_SHAPES}
            backends[name] = attn
        except Exception as e:  # noqa: BLE001 - a kernel that fails here is simply not chosen
            log.warning("attention probe: %s failed (%s: %s); not used", name, type(e).__name__, e)
    if not micros:
        return ProbeResult([(last, "torch_flash")], "torch_flash",
                           {"torch_flash": make_backend("torch_flash", device, dtype)})

    def fastest(shapes: list[tuple[int, int]]) -> str:
        return min(micros, key=lambda b: sum(micros[b][f"{s}x{n}"] for s, n in shapes))

    rules: list[tuple[int, str]] = []
    for max_tokens, shapes in sorted(GRAPH_CLASSES.items()):
        best = fastest(shapes)
        if rules and rules[-1][1] == best:
            rules[-1] = (max_tokens, best)  # one rule for adjacent classes with the same kernel
        else:
            rules.append((max_tokens, best))
    result = ProbeResult(rules, fastest(LARGE_SHAPES), backends, micros)
    table = "; ".join(f"{b}: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items()) for b, m in micros.items())
    log.info("attention probe (µs per layer call; graph shapes replayed, large shapes eager): %s -> graphs: %s, "
             "large eager steps: %s", table, rules, result.eager)
    return result
