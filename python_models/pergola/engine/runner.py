"""ModelRunner: owns the model, its device buffers, the CUDA graphs and the attention backend.

On a GPU every step goes through fixed device buffers: the host packs a step's inputs into a
pinned staging buffer (one of two, so step N+1 is packed while step N runs), one async copy per
dtype moves them, and the forward reads views of fixed addresses, which is what lets a CUDA
graph captured for a bucket replay any later step of that bucket. On the CPU the runner just
builds tensors and calls the model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch

from pergola.config.engine import DTYPES, EngineConfig
from pergola.config.hf_folder import ModelSpec
from pergola.engine.graphs import GraphCache
from pergola.engine.lazy import LazyTensor
from pergola.layers.attention import AttentionBackend, AttentionMetadata, make_backend
from pergola.layers.attention_probe import ProbeResult
from pergola.layers.attention_probe import probe as probe_attention
from pergola.layers.linear import tiles_for
from pergola.models.loader import build_model
from pergola.outputs.heads import HEAD_TASKS
from pergola.outputs.pooling import ROW_POOLING, TokenHeads, pool, pooled_rows

log = logging.getLogger("pergola.runner")

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES: the names a config takes


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, 0.. within each sequence
    token_types: torch.Tensor  # [T] int64
    seq_ids: torch.Tensor  # [T] int64, sequence index of each token (mean pooling)
    token_weights: torch.Tensor | None  # [T] fp32, 0 for tokens pooling skips (prompt, padding)
    meta: AttentionMetadata
    segments: torch.Tensor | None = None  # [T] int64, late chunking's atom of each token (G: none)
    num_segments: int = 0  # G


def host_inputs(lengths: np.ndarray, skips: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(positions [T], seq_ids [T], weights [T] or None) for a ragged batch, computed on the host."""
    num_tokens = int(lengths.sum())
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    seq_ids = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    positions = np.arange(num_tokens, dtype=np.int64) - starts[seq_ids]
    weights = None
    if skips is not None and skips.any():
        weights = (positions >= skips[seq_ids]).astype(np.float32)
    return positions, seq_ids, weights


class StaticBuffers:
    """Fixed device buffers for up to `max_tokens` tokens / `max_seqs` sequences, and pinned staging.

    Layout for a step padded to t tokens and s sequences (views at fixed offsets per (s, t)):
      i64[0:t] ids | i64[t:2t] positions | i64[2t:3t] token types | i64[3t:4t] sequence ids
      i32[0:s+1] cu_seqlens, f32[0:t] pooling weights, pooled[0:s] output [s, out_dim] fp32,
      tokens[0:t] per-token output [t, token_width] fp32 (bge-m3's heads; None without them).
    """

    def __init__(self, max_tokens: int, max_seqs: int, out_dim: int, device: torch.device,
                 token_width: int = 0) -> None:
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.i64 = torch.zeros(4 * max_tokens, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.f32 = torch.zeros(max_tokens, dtype=torch.float32, device=device)
        self.pooled = torch.zeros(max_seqs, out_dim, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_tokens, token_width, device=device) if token_width else None
        self._host = [self._staging() for _ in range(2)]
        self._slot = 0

    def _staging(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.empty(4 * self.max_tokens, dtype=torch.int64, pin_memory=True),
                torch.empty(self.max_seqs + 1, dtype=torch.int32, pin_memory=True),
                torch.empty(self.max_tokens, dtype=torch.float32, pin_memory=True))

    def fill(self, ids: np.ndarray, lengths: np.ndarray, skips: np.ndarray | None,
             token_types: np.ndarray | None, s: int, t: int) -> None:
        """Pack one step (B real sequences, T real tokens) padded to (s, t) and copy it over.

        Padding tokens form one extra sequence (index B) with pooling weight 0; sequences
        B+1..s-1 are empty. Attention never mixes them with real ones (cu_seqlens keeps them apart).
        """
        b, n = len(lengths), int(ids.shape[0])
        h64, h32, hf = self._host[self._slot]
        self._slot ^= 1
        v64, v32, vf = h64.numpy(), h32.numpy(), hf.numpy()
        positions, seq_ids, weights = host_inputs(lengths, skips)
        v64[0:n] = ids
        v64[n:t] = 0
        v64[t:t + n] = positions
        v64[t + n:2 * t] = 0
        if token_types is None:
            v64[2 * t:3 * t] = 0
        else:
            v64[2 * t:2 * t + n] = token_types
            v64[2 * t + n:3 * t] = 0
        v64[3 * t:3 * t + n] = seq_ids
        v64[3 * t + n:4 * t] = b
        v32[0] = 0
        np.cumsum(lengths, out=v32[1:b + 1])
        v32[b + 1:s + 1] = t
        vf[0:n] = 1.0 if weights is None else weights
        vf[n:t] = 0.0
        self.cu_seqlens_host = h32[:s + 1]  # for backends that plan on the host (FlashInfer)
        self.i64[:4 * t].copy_(h64[:4 * t], non_blocking=True)
        self.i32[:s + 1].copy_(h32[:s + 1], non_blocking=True)
        self.f32[:t].copy_(hf[:t], non_blocking=True)

    def inputs(self, s: int, t: int, max_seqlen: int, causal: bool, plan: object | None = None) -> BatchInputs:
        meta = AttentionMetadata(cu_seqlens=self.i32[:s + 1], max_seqlen=max_seqlen, causal=causal, plan=plan)
        return BatchInputs(self.i64[0:t], self.i64[t:2 * t], self.i64[2 * t:3 * t], self.i64[3 * t:4 * t],
                           self.f32[:t], meta)


@dataclass
class Lane:
    """What one stream of steps needs of its own on a GPU: fixed device buffers, the CUDA graphs
    captured over them, the pinned result buffers and each graph key's attention plan. Lane 0
    takes every step; with `query_tokens` set, lane 1 takes queries' small steps, which may run
    between the layers of a lane-0 step in flight (engine/loop.py), so it must not touch lane 0's
    buffers. Both lanes issue their work on the thread's current stream."""

    buffers: StaticBuffers
    graphs: GraphCache | None
    results: list[torch.Tensor]  # two pinned [max_seqs, out_dim] buffers, used in turn
    plans: dict[tuple[int, int], object | None]
    next_result: int = 0


class ModelRunner:
    def __init__(self, spec: ModelSpec, cfg: EngineConfig, device: torch.device) -> None:
        self.spec = spec
        self.cfg = cfg
        self.device = device
        self.dtype = TORCH_DTYPES[cfg.compute_dtype]
        # Where start-up goes (seconds): CUDA context, weights, attention probe; logged.
        self.startup: dict[str, float] = {}
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the CUDA context (first use in the process) is timed on its own
            self.startup["cuda_init"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        self.matmul_tiles = tiles_for(cfg.matmul, device)  # Triton matmul tiles by M, measured per GPU
        self.model = build_model(spec, device, self.dtype, self.matmul_tiles,  # each projection keeps its rows
                                 cfg.quantization, cfg.fold_norms, cfg.fp8_bf16_layers)
        # bge-m3's sparse / ColBERT heads: every step's hidden states go through them (TokenHeads).
        self.token_heads = TokenHeads(spec, device, self.dtype) if spec.token_heads else None
        self.token_width = self.token_heads.width if self.token_heads is not None else 0
        # CLS / last-token pooling: the last layer runs on the pooled rows only (Model.takes_rows).
        self.rows_only = (cfg.prune_last_layer and spec.pooling in ROW_POOLING
                          and self.model.takes_rows(spec.pooling))
        self.startup["weights"] = time.perf_counter() - t0
        self.probe: ProbeResult | None = None
        # (most tokens, backend) rules for graph steps, and the backend of large eager steps.
        self.graph_attn, self.eager_attn = self._attention_backends()
        self.max_positions = int(spec.hf_config.get("max_position_embeddings", 1 << 30))
        # What a step returns per sequence: the pooled embedding, or a reranker's or classifier's logits.
        self.out_dim = spec.num_labels if spec.task in HEAD_TASKS else spec.hidden_size
        # Lanes (GPU, ragged backends): 0 for every step, 1 for queries' steps when query_tokens is set.
        # Padded backends (SDPA: FP32 on a GPU) and the CPU build their own tensors per step.
        self.lanes: list[Lane] = []
        self.last_mode = "eager"  # what the last step did: eager / warmup / capture / replay
        # The last step's host phases, time.monotonic_ns(): inputs in the step's buffers ("filled"),
        # attention planned ("planned"), forward queued on the device ("queued"; on a CPU: run). Three
        # clock reads a step, for Engine.last_step_marks.
        self.last_marks: dict[str, int] = {}
        self.layer_hook: Callable[[], None] | None = None  # called between the layers of hooked eager steps
        self._hook_armed = self._in_hook = False
        self._plain_results: list[torch.Tensor] = []  # a GPU without lanes (padded backends): pinned results
        use_lanes = device.type == "cuda" and not self.attn.needs_padding
        if use_lanes:
            self.lanes.append(self._lane(max(cfg.step_tokens, spec.max_seq_length), 0))
            if cfg.query_tokens:
                self.lanes.append(self._lane(min(cfg.query_tokens, self.lanes[0].buffers.max_tokens), 1))
        elif device.type == "cuda":
            self._plain_results = [torch.empty(cfg.max_batch_seqs + 1, self.out_dim, pin_memory=True) for _ in range(2)]
        self._between_layers_hooks()
        log.info("runner ready: %s", self.startup_line())

    def _lane(self, max_tokens: int, index: int) -> Lane:
        max_seqs = self.cfg.max_batch_seqs + 1  # + the padding sequence
        buffers = StaticBuffers(max_tokens, max_seqs, self.out_dim, self.device, self.token_width)
        graphs = None
        # Graphs only where every graph-step kernel declares itself graph-safe.
        graph_safe = all(attn.graph_safe for _, attn in self.graph_attn)
        if graph_safe and not self.cfg.enforce_eager and self.cfg.cuda_graph_max_tokens > 0:
            graphs = GraphCache(partial(self._static_forward, index), min(self.cfg.cuda_graph_max_tokens, max_tokens),
                                max_seqs)
        # Two pinned result buffers: step N+1's result lands in one while step N's is read.
        results = [torch.empty(max_seqs, self.out_dim, pin_memory=True) for _ in range(2)]
        return Lane(buffers, graphs, results, {})

    def _between_layers_hooks(self) -> None:
        """Call `layer_hook` after each transformer layer of an armed (lane-0 eager) step: the
        encode loop throttles the host there and slips queries' steps in (engine/loop.py)."""
        layers = next((m for m in self.model.modules() if isinstance(m, torch.nn.ModuleList)
                       and len(m) == self.spec.hf_config.get("num_hidden_layers")), None)
        if layers is None:
            return

        def after(*_) -> None:
            if self._hook_armed and not self._in_hook and self.layer_hook is not None:
                self._in_hook = True  # a query's step run from the hook is not hooked in turn
                try:
                    self.layer_hook()
                finally:
                    self._in_hook = False

        for layer in layers:
            layer.register_forward_hook(after)

    @property
    def buffers(self) -> StaticBuffers | None:
        return self.lanes[0].buffers if self.lanes else None

    @property
    def graphs(self) -> GraphCache | None:
        return self.lanes[0].graphs if self.lanes else None

    @property
    def query_lane(self) -> int:
        """The lane of queries' steps: 1 when it exists, else 0."""
        return len(self.lanes) - 1 if self.lanes else 0

    def startup_line(self) -> str:
        """'cuda_init 0.16 s, weights 4.41 s, attention_probe 0.96 s': the start-up split, for logs."""
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.startup.items())

    @property
    def attn(self) -> AttentionBackend:
        """The kernel of the smallest steps (batch-1 queries): the first graph rule's."""
        return self.graph_attn[0][1]

    def attention_heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head dim) of the model's attention."""
        cfg = self.spec.hf_config
        heads = cfg["num_attention_heads"]
        return heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads

    def _attention_backends(self) -> tuple[list[tuple[int, AttentionBackend]], AttentionBackend]:
        """(rules (most tokens, backend) for graph-sized steps, backend of large eager steps).

        "auto" on a GPU in half precision measures the available kernels at start-up
        (layers/attention_probe.py) and may pick one kernel per class of graph step size; an
        explicit name is used as given, for every step. Large eager steps may use another kernel
        than graphs: `eager_attention_backend` ("auto": the probe's choice, or the same as
        `attention_backend` when that is explicit).
        """
        cfg, device = self.cfg, self.device
        if cfg.attention_backend == "auto" and device.type == "cuda" and self.dtype != torch.float32:
            t0 = time.perf_counter()
            self.probe = probe_attention(*self.attention_heads(), self.spec.causal, device, self.dtype,
                                         probe_fa4=cfg.probe_fa4)
            self.startup["attention_probe"] = time.perf_counter() - t0
            rules = [(tokens, self.probe.backends[name]) for tokens, name in self.probe.graph_rules]
            eager_name = self.probe.eager
        else:
            rules = [(1 << 62, make_backend(cfg.attention_backend, device, self.dtype))]
            eager_name = rules[0][1].name
        if cfg.eager_attention_backend not in ("", "auto"):
            eager_name = cfg.eager_attention_backend
        known = {attn.name: attn for _, attn in rules} | (self.probe.backends if self.probe else {})
        return rules, known.get(eager_name) or make_backend(eager_name, device, self.dtype)

    def graph_backend(self, num_tokens: int) -> AttentionBackend:
        """The attention kernel of a graph step of `num_tokens` (padded) tokens."""
        for max_tokens, attn in self.graph_attn:
            if num_tokens <= max_tokens:
                return attn
        return self.graph_attn[-1][1]

    def attention_in_use(self) -> dict[str, str]:
        """use -> kernel, for logs and metrics: "graph" (or "graph_upto_N" per size class), "eager"."""
        if self.graphs is None:
            return {"eager": self.eager_attn.name}
        if len(self.graph_attn) == 1:
            return {"graph": self.attn.name, "eager": self.eager_attn.name}
        return {f"graph_upto_{tokens}": attn.name for tokens, attn in self.graph_attn} | {"eager": self.eager_attn.name}

    # --- CPU path -------------------------------------------------------------------------
    def prepare(self, input_ids: np.ndarray, lengths: np.ndarray, skips: np.ndarray | None = None,
                token_types: np.ndarray | None = None) -> BatchInputs:
        """Tensors for one step without static buffers (CPU, or tests of the eager path)."""
        positions, seq_ids, weights = host_inputs(lengths, skips)
        dev = self.device
        types = token_types if token_types is not None else np.zeros(len(input_ids), dtype=np.int64)
        meta = AttentionMetadata.build(lengths.tolist(), dev, causal=self.spec.causal,
                                       padded=self.attn.needs_padding)
        return BatchInputs(self._put(input_ids.astype(np.int64, copy=False)), self._put(positions),
                           self._put(types.astype(np.int64, copy=False)), self._put(seq_ids),
                           None if weights is None else self._put(weights), meta)

    def _put(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    def _with_segments(self, b: BatchInputs, segments: np.ndarray | None) -> BatchInputs:
        """`b` with late chunking's atoms ([T] int64, -1: none; pergola.text.chunking), when the step has any."""
        if segments is None:
            return b
        count = int(segments.max()) + 1
        return replace(b, segments=self._put(np.where(segments < 0, count, segments)), num_segments=count)

    @torch.inference_mode()
    def forward(self, b: BatchInputs, attn: AttentionBackend | None = None, token_rows: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> (pooled [B, hidden] fp32 on the device (a reranker or classifier: its logits [B, num_labels]),
        per-token rows [T, token_width] fp32 of bge-m3's heads, None for a model without them or a step
        that asks for none (`token_rows` False), late chunking's atom sums [G, hidden] fp32 of the last
        hidden states, None without b.segments)."""
        attn = attn or self.attn
        if self.rows_only and b.segments is None and not (token_rows and self.token_heads is not None):
            rows = pooled_rows(b.meta.cu_seqlens, self.spec.pooling, b.input_ids.shape[0])  # [B]
            pooled = self.model(b.input_ids, b.positions, b.token_types, b.meta, attn, rows=rows).float()
            return self._head(pooled), None, None
        hidden = self.model(b.input_ids, b.positions, b.token_types, b.meta, attn)
        tokens = None if self.token_heads is None else self.token_heads(hidden)
        sums = None
        if b.segments is not None:  # (fp32 sums, as mean pooling's; the extra row G takes the unpooled tokens)
            sums = torch.zeros(b.num_segments + 1, hidden.shape[1], device=hidden.device, dtype=torch.float32)
            sums = sums.index_add_(0, b.segments, hidden.float())[:b.num_segments]
        pooled = pool(hidden, b.meta.cu_seqlens, b.seq_ids, self.spec.pooling, b.token_weights)
        return self._head(pooled), tokens, sums

    def _head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled [B, hidden] fp32 -> what a step returns: a reranker's or classifier's logits, else the embedding."""
        return self.model.score(pooled) if self.spec.task in HEAD_TASKS else self.dense_rows(pooled)

    def dense_rows(self, pooled: torch.Tensor) -> torch.Tensor:
        """The sentence-transformers Dense modules, after pooling ([B, hidden] -> [B, out] fp32); as is without them."""
        dense = getattr(self.model, "dense", None)
        return pooled if dense is None else dense(pooled.to(self.dtype)).float()

    # --- GPU path -------------------------------------------------------------------------
    @torch.inference_mode()
    def _static_forward(self, lane: int, s: int, t: int, token_rows: bool = True, *, max_seqlen: int | None = None,
                        attn: AttentionBackend | None = None, plan: object | None = None,
                        segments: np.ndarray | None = None) -> torch.Tensor | None:
        """Forward over `lane`'s static buffers padded to (s, t); writes pooled[:s] (and tokens[:t]). Graph-safe.

        GraphCache calls it with its key only, (lane, s, t) or (lane, s, t, token_rows), to warm up
        and capture a graph: the kernel of that step size, with the plan step() made for (s, t) (kept
        by the graph for its replays). bge-m3's per-token rows are computed only when asked
        (`token_rows`); with `rows_only` its last layer otherwise runs on the pooled rows alone.
        """
        buffers = self.lanes[lane].buffers
        if attn is None:
            attn, plan = self.graph_backend(t), self.lanes[lane].plans[(s, t)]
        # In a graph the longest sequence is unknown at capture: t bounds it.
        b = self._with_segments(buffers.inputs(s, t, max_seqlen or t, self.spec.causal, plan), segments)
        pooled, tokens, sums = self.forward(b, attn, token_rows)
        buffers.pooled[:s].copy_(pooled)
        if tokens is not None:
            buffers.tokens[:t].copy_(tokens)
        return sums  # (late chunking's, on eager steps only: a graph's step has none)

    def _plan(self, lane: Lane, attn: AttentionBackend, graph_key: tuple[int, int] | None = None) -> object | None:
        """The step's attention plan, for its metadata: host work once per step (FlashInfer), else None."""
        if not attn.needs_plan:
            return None
        return attn.plan(lane.buffers.cu_seqlens_host, *self.attention_heads(), self.spec.causal, graph_key=graph_key)

    def step(self, input_ids: np.ndarray, lengths: np.ndarray, skips: np.ndarray | None = None,
             token_types: np.ndarray | None = None, lane: int = 0, hooked: bool = False,
             token_columns: int = 0, segments: np.ndarray | None = None) -> LazyTensor:
        """Launch one step (forward + pooling + copy to host) on `lane` and return without waiting.
        A `hooked` step calls `layer_hook` between its layers when it runs eagerly; the first
        `token_columns` columns of the per-token rows of bge-m3's heads come to the host too
        (LazyTensor.tokens; 1: the sparse weights alone); with `segments` ([T] int64 atoms of late
        chunking, -1: none) the sums of each atom's hidden states (LazyTensor.segments), and the
        step runs eagerly (its atoms are not a graph's fixed shape)."""
        if not self.lanes:
            with self._armed(hooked):
                b = self._with_segments(self.prepare(input_ids, lengths, skips, token_types), segments)
                filled = time.monotonic_ns()
                pooled, rows, sums = self.forward(b, token_rows=token_columns > 0)
                self.last_marks = {"filled": filled, "planned": filled, "queued": time.monotonic_ns()}
                return self._lazy(pooled, tokens=rows[:, :token_columns] if token_columns else None, segments=sums)
        return self._lane_step(lane, input_ids, lengths, skips, token_types, hooked, token_columns, segments)

    def _lane_step(self, lane: int, input_ids: np.ndarray, lengths: np.ndarray, skips: np.ndarray | None,
                   token_types: np.ndarray | None, hooked: bool, token_columns: int,
                   segments: np.ndarray | None = None) -> LazyTensor:
        ln = self.lanes[lane]
        num_seqs, num_tokens = len(lengths), int(input_ids.shape[0])
        key = ln.graphs.key_for(num_seqs, num_tokens) if ln.graphs is not None and segments is None else None
        if key is not None and self.rows_only and self.token_heads is not None:
            # bge-m3 pruned: a step without per-token rows runs a graph of its own, its last layer on the pooled rows
            key = (*key, token_columns > 0)
        s, t = key[:2] if key is not None else (num_seqs, num_tokens)
        ln.buffers.fill(input_ids, lengths, skips, token_types, s, t)
        filled = time.monotonic_ns()
        sums = None
        if key is not None:
            # Planned for the key before every run: a replay runs the plan captured with the graph,
            # which the backend has just re-planned in place (FlashInfer: the key's own wrapper of
            # this lane's stream, and steps of one stream are ordered: a re-plan never races a replay).
            ln.plans[(s, t)] = self._plan(ln, self.graph_backend(t), graph_key=(s, t))
            planned = time.monotonic_ns()
            self.last_mode = ln.graphs.run(key)
        else:
            # Above the graph crossover (or with late chunking's atoms): eager, with the backend measured
            # fastest for big steps.
            plan = self._plan(ln, self.eager_attn)
            planned = time.monotonic_ns()
            with self._armed(hooked):
                sums = self._static_forward(lane, s, t, max_seqlen=int(lengths.max()), attn=self.eager_attn, plan=plan,
                                            segments=segments, token_rows=token_columns > 0)
            self.last_mode = "eager"
        self.last_marks = {"filled": filled, "planned": planned, "queued": time.monotonic_ns()}
        rows = ln.buffers.tokens[:num_tokens, :token_columns] if token_columns else None
        return self._lazy(ln.buffers.pooled[:num_seqs], ln, rows, sums)

    @contextmanager
    def _armed(self, on: bool):
        """Let `layer_hook` run between this step's layers (not inside the hook itself)."""
        if not on or self.layer_hook is None or self._hook_armed or self._in_hook:
            yield
            return
        self._hook_armed = True
        try:
            yield
        finally:
            self._hook_armed = False

    def _lazy(self, pooled: torch.Tensor, lane: Lane | None = None, tokens: torch.Tensor | None = None,
              segments: torch.Tensor | None = None) -> LazyTensor:
        if pooled.device.type == "cpu":
            return LazyTensor(pooled, tokens=tokens, segments=segments)
        if lane is None:  # a GPU without lanes: the plain pair of result buffers
            self._plain_results.reverse()
            return LazyTensor(pooled, self._plain_results[0], tokens, segments)
        host = lane.results[lane.next_result]
        lane.next_result ^= 1
        return LazyTensor(pooled, host, tokens, segments)
