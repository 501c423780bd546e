"""First-come-first-served packing of sequences into token-budgeted steps. No torch here.

Why FCFS is enough: for small embedding models the dense layers' linear cost dominates
attention's quadratic cost, so a step's time follows its token count; once a step holds
enough tokens to saturate the GPU, packing more sequences does not make it more efficient.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator


@dataclass(frozen=True)
class Sequence:
    request: int  # index of the request in the current execute() call
    index: int  # row of the sequence inside its request
    start: int  # offset of its first token in the request's flat ids
    length: int


@dataclass
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: int = 0


class TokenBudgetScheduler:
    """Queue of sequences; `next_step()` takes them in arrival order until the budget is full.

    A request larger than the budget is split across steps; a single sequence longer than the
    budget runs alone in its own step rather than being refused.
    """

    def __init__(self, max_batch_tokens: int, max_batch_seqs: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: int, lengths: list[int]) -> None:
        start = 0
        for i, n in enumerate(lengths):
            self._queue.append(Sequence(request, i, start, int(n)))
            start += int(n)

    def next_step(self) -> Step | None:
        if not self._queue:
            return None
        step = Step()
        while self._queue and len(step.seqs) < self.max_batch_seqs:
            seq = self._queue[0]
            if step.seqs and step.num_tokens + seq.length > self.max_batch_tokens:
                break  # stop at the first sequence that does not fit: strict FCFS
            step.seqs.append(self._queue.popleft())
            step.num_tokens += seq.length
        return step

    def steps(self) -> Iterator[Step]:
        while (step := self.next_step()) is not None:
            yield step
