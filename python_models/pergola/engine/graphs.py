"""Whole-model CUDA graphs keyed by (sequence-count bucket, token-count bucket), captured lazily.

A key's first use runs eagerly on the padded static buffers (warm-up: kernel selection,
workspaces), its second use captures, later uses replay: one driver call for the whole forward,
so small batches are no longer bound by Python and kernel launches. Start-up captures nothing.
Above `max_graph_tokens` (the crossover where GPU time dwarfs launch cost) steps run eagerly.
A capture that fails leaves its bucket eager for good (logged, counted): nothing runs during a
capture, so the device is as it was, and a step that can be computed must not end the server
(a capture once failed on a thread without a cuBLAS handle and took the encoder down, 1c7126f).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pergola.layers.cudagraph import capture

log = logging.getLogger("pergola.graphs")


def token_buckets(max_tokens: int, fine_step: int = 64, coarse_from: int = 1024, coarse_step: int = 256) -> list[int]:
    """Token counts padded to multiples of 64, then of 256 above `coarse_from`: the one bucket list."""
    fine = list(range(fine_step, min(coarse_from, max_tokens) + 1, fine_step))
    coarse = list(range(coarse_from + coarse_step, max_tokens + 1, coarse_step))
    buckets = fine + coarse
    if not buckets or buckets[-1] < max_tokens:
        buckets.append(max_tokens)
    return buckets


def seq_buckets(max_seqs: int) -> list[int]:
    """Powers of two up to max_seqs (sequence counts include the padding sequence)."""
    out, n = [], 1
    while n < max_seqs:
        out.append(n)
        n *= 2
    out.append(max_seqs)
    return out


def round_up(value: int, buckets: list[int]) -> int | None:
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


# (sequence-count bucket, token-count bucket), from key_for; the runner may add a variant of the
# forward after them (bge-m3's per-token rows computed or not), which forward(*key) receives.
GraphKey = tuple[int, ...]


@dataclass
class GraphStats:
    eager_warmups: int = 0
    captures: int = 0
    replays: int = 0
    failed_captures: int = 0
    keys: set[GraphKey] = field(default_factory=set)


class GraphCache:
    """Lazy capture + replay of `forward()` over static buffers that the runner fills in place."""

    def __init__(self, forward: Callable[..., None], max_graph_tokens: int, max_seqs: int) -> None:
        self.forward = forward  # forward(*key): reads/writes static buffers
        self.tokens = token_buckets(max_graph_tokens)
        self.seqs = seq_buckets(max_seqs)
        self.pool = None  # the memory pool every bucket's graph shares, made at the first capture
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.seen: set[GraphKey] = set()
        self.uncapturable: set[GraphKey] = set()  # keys whose capture failed: eager from then on
        self.stats = GraphStats()

    def key_for(self, num_seqs: int, num_tokens: int) -> tuple[int, int] | None:
        """Bucket key, or None when the step should run eagerly (over the crossover)."""
        t = round_up(num_tokens, self.tokens)
        # One extra sequence holds the padding tokens when the token count is rounded up.
        s = round_up(num_seqs + (t is not None and t > num_tokens), self.seqs)
        if t is None or s is None:
            return None
        return s, t

    def run(self, key: GraphKey) -> str:
        """Run the step for `key` (inputs already in the static buffers); returns what it did."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.stats.replays += 1
            return "replay"
        if key in self.uncapturable:
            self.forward(*key)
            return "eager"
        if key not in self.seen:
            self.seen.add(key)
            self.forward(*key)
            self.stats.eager_warmups += 1
            return "warmup"
        try:
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:  # (here, not at start: a CPU-only torch has no CUDA graph classes)
                self.pool = torch.cuda.graph_pool_handle()
            capture(graph, lambda: self.forward(*key), self.pool)
        except Exception as e:  # noqa: BLE001 - computed eagerly instead; a poisoned device fails there
            self.uncapturable.add(key)
            self.stats.failed_captures += 1
            log.warning("CUDA graph capture for %d seqs x %d tokens failed (%s: %s); that bucket runs "
                        "eagerly from now on", key[0], key[1], type(e).__name__, str(e).splitlines()[0][:200])
            self.forward(*key)
            return "eager"
        # Capture records without executing: replay once so this step's outputs are real.
        graph.replay()
        self.graphs[key] = graph
        self.stats.captures += 1
        self.stats.keys.add(key)
        log.info("captured CUDA graph for %d seqs x %d tokens (%d graphs)", key[0], key[1], len(self.graphs))
        return "capture"
