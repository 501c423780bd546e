"""The engine: scheduler (token-budget FCFS) + runner (model, device) joined by a short loop."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from pergola.config import EngineConfig
from pergola.engine.lazy import LazyTensor
from pergola.engine.runner import ModelRunner
from pergola.engine.scheduler import Step, TokenBudgetScheduler
from pergola.errors import RequestError


@dataclass
class EncodeRequest:
    input_ids: np.ndarray  # [T] int64, texts concatenated
    lengths: np.ndarray  # [n] int32
    prompt_lengths: np.ndarray | None = None  # [n] tokens left out of mean pooling
    token_types: np.ndarray | None = None  # [T] segment ids (cross-encoder pairs)


class Engine:
    """Pools the hidden states of every sequence of every request, batching across requests."""

    def __init__(self, cfg: EngineConfig, device: str | torch.device | None = None) -> None:
        self.cfg = cfg
        self.spec = cfg.spec()
        self.device = torch.device(device or cfg.device)
        self.runner = ModelRunner(self.spec, cfg, self.device)
        self.vocab_size = int(self.spec.hf_config["vocab_size"])
        # Running totals for metrics: requests, sequences, tokens, steps, and steps by mode
        # (steps_eager / steps_warmup / steps_capture / steps_replay).
        self.stats: Counter[str] = Counter()

    def validate(self, req: EncodeRequest) -> None:
        """Refuse malformed pre-tokenized input before it can reach a kernel."""
        lengths = req.lengths
        if lengths.ndim != 1 or lengths.size == 0:
            raise RequestError("LENGTHS must be a non-empty 1-D list of token counts")
        if lengths.size > self.cfg.max_texts:
            raise RequestError(f"{lengths.size} sequences in one request; the limit is {self.cfg.max_texts}")
        if (lengths < 1).any():
            raise RequestError(f"LENGTHS[{int(np.argmin(lengths))}] is {int(lengths.min())}; every sequence needs a token")
        if int(lengths.max()) > min(self.runner.max_positions, self.spec.max_seq_length):
            limit = min(self.runner.max_positions, self.spec.max_seq_length)
            raise RequestError(f"a sequence has {int(lengths.max())} tokens; this model takes at most {limit}")
        if int(lengths.sum()) != req.input_ids.size:
            raise RequestError(f"LENGTHS add up to {int(lengths.sum())} but INPUT_IDS has {req.input_ids.size} tokens")
        if req.token_types is not None and req.token_types.size != req.input_ids.size:
            raise RequestError(f"TOKEN_TYPE_IDS has {req.token_types.size} values for {req.input_ids.size} tokens")
        if req.input_ids.size and (req.input_ids.min() < 0 or req.input_ids.max() >= self.vocab_size):
            raise RequestError(f"INPUT_IDS must lie in [0, {self.vocab_size}) for this model's vocabulary")

    def _gather(self, requests: list[EncodeRequest], step: Step):
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

    def encode(self, requests: list[EncodeRequest]) -> list[np.ndarray]:
        """-> one [n_i, out_dim] fp32 array per request: pooled embeddings (not yet truncated or
        normalised), or a reranker's scores."""
        width = self.runner.out_dim
        results = [np.empty((r.lengths.size, width), dtype=np.float32) for r in requests]
        scheduler = TokenBudgetScheduler(self.cfg.max_batch_tokens, self.cfg.max_batch_seqs)
        for i, r in enumerate(requests):
            scheduler.add(i, r.lengths.tolist())

        def collect(step: Step, lazy: LazyTensor) -> None:
            values = lazy.wait()
            for row, s in enumerate(step.seqs):
                results[s.request][s.index] = values[row]

        inflight: tuple[Step, LazyTensor] | None = None
        self.stats.update(requests=len(requests), sequences=sum(r.lengths.size for r in requests),
                          tokens=sum(r.input_ids.size for r in requests))
        for step in scheduler.steps():
            lazy = self.runner.step(*self._gather(requests, step))  # packed while the last step runs
            self.stats.update(steps=1, **{f"steps_{self.runner.last_mode}": 1})
            if inflight is not None:
                collect(*inflight)
            inflight = (step, lazy)
        if inflight is not None:
            collect(*inflight)
        return results
