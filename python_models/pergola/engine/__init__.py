"""The engine: scheduler (token-budgeted steps) + runner (model, device) joined by a short loop.

`Engine.encode` runs a list of requests to the end (tests, benchmarks, in-process use); the
server feeds the same steps from a background loop that takes requests as they arrive
(engine/loop.py)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pergola.config.engine import EngineConfig
from pergola.engine.lazy import LazyTensor
from pergola.engine.runner import ModelRunner
from pergola.engine.scheduler import Step, WorkQueue
from pergola.text.chunking import SpanPlan
from pergola.text.errors import RequestError


@dataclass
class EncodeRequest:
    input_ids: np.ndarray  # [T] int64, texts concatenated
    lengths: np.ndarray  # [n] int32
    prompt_lengths: np.ndarray | None = None  # [n] tokens left out of mean pooling
    token_types: np.ndarray | None = None  # [T] segment ids (cross-encoder pairs)
    # [T, columns] fp32, given to get bge-m3's per-token outputs: the first columns of the runner's
    # per-token rows (token_outputs.row_width), filled as its steps finish.
    token_rows: np.ndarray | None = None
    # Late chunking (pergola.text.chunking.SpanPlan): [T] int64, each token's atom (-1: none), and
    # [atoms, hidden] fp32, the sums of each atom's last hidden states, filled as its steps finish.
    segments: np.ndarray | None = None
    segment_sums: np.ndarray | None = None


class Engine:
    """Pools the hidden states of every sequence of every request, batching across requests."""

    def __init__(self, cfg: EngineConfig, device: str | torch.device | None = None) -> None:
        self.cfg = cfg
        self.spec = cfg.spec()
        self.device = torch.device(device or cfg.device)
        self.runner = ModelRunner(self.spec, cfg, self.device)
        self.vocab_size = int(self.spec.hf_config["vocab_size"])
        # Segment ids the model embeds (BERT's token types); a model without them takes only 0.
        types = getattr(getattr(self.runner.model, "embeddings", None), "token_type_embeddings", None)
        self.type_vocab_size = types.num_embeddings if types is not None else 1
        # Running totals for metrics: requests, sequences, tokens, steps, and steps by mode
        # (steps_eager / steps_warmup / steps_capture / steps_replay).
        self.stats: Counter[str] = Counter()
        # The last step launched, time.monotonic_ns() in order: gathered (its ids from the requests),
        # filled, planned, queued (ModelRunner.last_marks), launched (its copy back queued too), and
        # after encode() on_host (its result back). The adapter's timing marks split a lone query's
        # engine time with them (pergola/triton/adapter_timing.py); a few clock reads a step.
        self.last_step_marks: dict[str, int] = {}

    def validate(self, req: EncodeRequest) -> None:
        """Refuse malformed pre-tokenized input before it can reach a kernel (or pool over no
        tokens: a silent zero vector). Every field is checked against the others."""
        lengths, ids = req.lengths, req.input_ids
        most = self.cfg.max_documents if self.spec.task == "rerank" else self.cfg.max_texts
        if lengths.ndim != 1 or lengths.size == 0:
            raise RequestError("LENGTHS must be a non-empty 1-D list of token counts")
        if lengths.size > most:
            raise RequestError(f"{lengths.size} sequences in one request; the limit is {most}")
        # Few numpy reductions: on a stub's path each costs microseconds (perf/results/2026-12-05-eb8e445-cpu/
        # NOTES.md), so one sequence is checked with Python ints and the ids with one max.
        if lengths.size == 1:
            shortest = longest = total = int(lengths[0])
        else:
            shortest, longest, total = int(lengths.min()), int(lengths.max()), int(lengths.sum(dtype=np.int64))
        if shortest < 1:
            raise RequestError(f"LENGTHS[{int(np.argmin(lengths))}] is {shortest}; every sequence needs a token")
        limit = min(self.runner.max_positions, self.spec.max_seq_length)
        if longest > limit:
            raise RequestError(f"a sequence has {longest} tokens; this model takes at most {limit}")
        if total != ids.size:
            raise RequestError(f"LENGTHS add up to {total} but INPUT_IDS has {ids.size} tokens")
        if ids.size and not self._in_vocabulary(ids):
            raise RequestError(f"INPUT_IDS must lie in [0, {self.vocab_size}) for this model's vocabulary")
        if req.prompt_lengths is not None:
            skips = req.prompt_lengths
            if skips.size != lengths.size:
                raise RequestError(f"PROMPT_LENGTHS has {skips.size} values for {lengths.size} sequences; send one "
                                   "per sequence")
            bad = np.flatnonzero((skips < 0) | (skips >= lengths))
            if bad.size:
                i = int(bad[0])
                raise RequestError(f"PROMPT_LENGTHS[{i}] is {int(skips[i])} for a sequence of {int(lengths[i])} tokens; "
                                   "it must be at least 0 and leave a token to pool")
        if req.token_types is not None:
            types = req.token_types
            if types.size != ids.size:
                raise RequestError(f"TOKEN_TYPE_IDS has {types.size} values for {ids.size} tokens")
            if types.size and (types.min() < 0 or types.max() >= self.type_vocab_size):
                raise RequestError(f"TOKEN_TYPE_IDS must lie in [0, {self.type_vocab_size}) for this model")

    def _in_vocabulary(self, ids: np.ndarray) -> bool:
        """Every id in [0, vocab_size): int64 ids (what Triton's INPUT_IDS holds) viewed as uint64 put
        the negative ones above every vocabulary, so one max checks both ends."""
        if ids.dtype == np.int64:
            return int(ids.view(np.uint64).max()) < self.vocab_size
        return int(ids.min()) >= 0 and int(ids.max()) < self.vocab_size

    def _gather(self, requests: Mapping[Hashable, EncodeRequest], step: Step):
        """The step's flat ids, lengths, pooling skips and token types, from its requests."""
        ids = np.concatenate([requests[s.request].input_ids[s.start:s.start + s.length] for s in step.seqs])
        lengths = np.fromiter((s.length for s in step.seqs), dtype=np.int32, count=len(step.seqs))
        skips = None
        if any(requests[s.request].prompt_lengths is not None for s in step.seqs):
            skips = np.array([0 if requests[s.request].prompt_lengths is None
                              else requests[s.request].prompt_lengths[s.index] for s in step.seqs], dtype=np.int64)
        types = None
        if any(requests[s.request].token_types is not None for s in step.seqs):
            types = np.concatenate([
                np.zeros(s.length, np.int64) if requests[s.request].token_types is None
                else requests[s.request].token_types[s.start:s.start + s.length] for s in step.seqs])
        return ids, lengths, skips, types

    @staticmethod
    def _step_segments(requests: Mapping[Hashable, EncodeRequest], step: Step) -> np.ndarray | None:
        """The step's tokens' atoms numbered within the step (step_atoms), -1 for none; None when
        no request of the step has any."""
        if all(requests[s.request].segments is None for s in step.seqs):
            return None
        parts = []
        for s, (first, base, count) in zip(step.seqs, step_atoms(step, requests.get)):
            if count == 0:
                parts.append(np.full(s.length, -1, np.int64))
                continue
            own = requests[s.request].segments[s.start:s.start + s.length]  # type: ignore[index]
            parts.append(np.where(own < 0, -1, own - first + base))
        return np.concatenate(parts)

    def launch(self, step: Step, requests: Mapping[Hashable, EncodeRequest], lane: int = 0,
               hooked: bool = False) -> LazyTensor:
        """Start one step on the device and return without waiting (LazyTensor). `lane` and
        `hooked`: see ModelRunner.step (the encode loop's query lane)."""
        columns = 0  # per-token rows to copy back: only a model with bge-m3's heads has any
        if self.runner.token_width:
            columns = max((requests[s.request].token_rows.shape[1] for s in step.seqs
                           if requests[s.request].token_rows is not None), default=0)
        inputs = self._gather(requests, step)
        gathered = time.monotonic_ns()
        lazy = self.runner.step(*inputs, lane=lane, hooked=hooked, token_columns=columns,
                                segments=self._step_segments(requests, step))
        self.last_step_marks = {"gathered": gathered, **self.runner.last_marks, "launched": time.monotonic_ns()}
        self.stats.update(steps=1, sequences=len(step.seqs), tokens=step.num_tokens,
                          **{f"steps_{self.runner.last_mode}": 1})
        return lazy

    def late_request(self, req: EncodeRequest, spans: np.ndarray) -> SpanPlan:
        """Make `req` (validated) carry late chunking's CHUNK_SPANS (pergola.text.chunking): its atoms,
        and room for their sums. RequestError for a model that is not an embedder, or bad spans."""
        if self.spec.task != "embed":
            raise RequestError(f"CHUNK_SPANS (late chunking) is for embedding models; this one is a {self.spec.task} "
                               "model")
        plan = SpanPlan.build(spans, req.lengths)
        req.segments = plan.segments
        req.segment_sums = np.zeros((plan.num_atoms, int(self.spec.hf_config["hidden_size"])), dtype=np.float32)
        return plan

    @torch.inference_mode()
    def late_vectors(self, req: EncodeRequest, plan: SpanPlan) -> np.ndarray:
        """Each late chunk's vector [k, out_dim] fp32, once `req`'s steps are done: the mean of its
        tokens' last hidden states, through the model's Dense modules when it has them (what its
        pooling feeds them), not yet truncated or normalised."""
        means = plan.means(req.segment_sums)  # type: ignore[arg-type]
        if getattr(self.runner.model, "dense", None) is None:
            return means
        return self.runner.dense_rows(torch.from_numpy(means).to(self.device)).cpu().numpy()

    def new_queue(self) -> WorkQueue:
        return WorkQueue(self.cfg.step_tokens, self.cfg.max_batch_seqs)

    def encode(self, requests: list[EncodeRequest], lane: int = 0) -> list[np.ndarray]:
        """-> one [n_i, out_dim] fp32 array per request: pooled embeddings (not yet truncated or
        normalised), or a reranker's or classifier's logits (pergola.outputs.heads.activate). Synchronous; the server runs the same steps from
        its own loop (engine/loop.py)."""
        width = self.runner.out_dim
        results = [np.empty((r.lengths.size, width), dtype=np.float32) for r in requests]
        queue, by_key = self.new_queue(), dict(enumerate(requests))
        for i, r in by_key.items():
            queue.add(i, r.lengths.tolist())
        self.stats.update(requests=len(requests))
        inflight: tuple[Step, LazyTensor] | None = None
        for step in queue.steps():
            lazy = self.launch(step, by_key, lane=lane)  # packed while the last step runs
            if inflight is not None:
                scatter(*inflight, results, by_key.get)
            inflight = (step, lazy)
        if inflight is not None:
            scatter(*inflight, results, by_key.get)
            self.last_step_marks["on_host"] = time.monotonic_ns()  # (the last step's: the last launched)
        return results


def scatter(step: Step, lazy: LazyTensor, results: Mapping[Hashable, np.ndarray] | list[np.ndarray],
            request_of: Callable[[Hashable], EncodeRequest | None]) -> None:
    """Wait for a step and copy each sequence's row into its request's result (and its per-token rows)."""
    values = lazy.wait()
    for row, s in enumerate(step.seqs):
        results[s.request][s.index] = values[row]
    file_rows(step, lazy, request_of)


def step_atoms(step: Step, request_of: Callable[[Hashable], EncodeRequest | None]) -> list[tuple[int, int, int]]:
    """Per sequence of the step, (its first atom in its request, its first row in the step's
    atom sums, its atoms): late chunking's atoms (pergola.text.chunking.SpanPlan) lie inside one
    sequence and are numbered in token order, so a sequence's are one run of numbers."""
    out, base = [], 0
    for s in step.seqs:
        request = request_of(s.request)
        segments = None if request is None or request.segments is None else request.segments[s.start:s.start + s.length]
        pooled = segments[segments >= 0] if segments is not None else segments
        if pooled is None or pooled.size == 0:
            out.append((0, base, 0))
            continue
        first, count = int(pooled.min()), int(pooled.max() - pooled.min()) + 1
        out.append((first, base, count))
        base += count
    return out


def file_rows(step: Step, lazy: LazyTensor, request_of: Callable[[Hashable], EncodeRequest | None]) -> None:
    """Copy the step's per-token rows ([step tokens, columns], sequences in step order) into the
    `token_rows` of the requests that gave one, as many columns as each has, and its atom sums into
    the `segment_sums` of those with late chunks (request_of: key -> request, None once it is
    gone). Call after lazy.wait()."""
    sums = lazy.segments()
    if sums is not None:
        for s, (first, base, count) in zip(step.seqs, step_atoms(step, request_of)):
            if count:
                request_of(s.request).segment_sums[first:first + count] = sums[base:base + count]  # type: ignore[union-attr]
    rows = lazy.tokens()
    if rows is None:
        return
    offset = 0
    for s in step.seqs:
        request = request_of(s.request)
        if request is not None and request.token_rows is not None:
            out = request.token_rows
            out[s.start:s.start + s.length] = rows[offset:offset + s.length, :out.shape[1]]
        offset += s.length
