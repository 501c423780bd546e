"""Long texts cut into windows (chunking), and late chunking's pooling of spans of one encoding.

Windows (docs/long-documents.md): a text's tokenization without special tokens, n tokens, is cut
on token boundaries into windows of `size` tokens, neighbours sharing `overlap`: window k holds
tokens [k·(size−overlap), k·(size−overlap)+size) ∩ [0, n) for k = 0, 1, … while
k·(size−overlap) < max(n − overlap, 1). A window's `text_span` runs from its first token's first
character to its last token's last (a text of no tokens: one window, the whole text).

- each / mean: a window is embedded as its own text, text[span], as if it were sent alone
  (TextTokenizer.chunk re-tokenizes it with the model's special tokens and prompt). Its tokens
  are then what sentence-transformers makes of that text, which can differ from the cut tokens
  where a window starts inside a word (WordPiece's "##ing" is "ing" on its own).
- late: the text is encoded once, in windows of the model's length (`budget` text tokens) with
  `overlap`, and each chunk's vector is the mean of the last hidden states of its own tokens in
  that encoding. A token inside two encoding windows is taken from the one where it sits further
  from an edge: ownership passes to the next window in the middle of their overlap.

The encoder pools late chunks from CHUNK_SPANS, rows (chunk, start, end) over a request's flat
INPUT_IDS: chunk c's vector is the mean of the hidden states of the tokens of its rows. Rows may
overlap (neighbouring chunks share tokens) and a chunk may have several (it crosses two encoding
windows). `SpanPlan` turns them into disjoint pieces ("atoms") so that a forward step sums each
token once, into one row per atom (ModelRunner: index_add, as mean pooling does per sequence); a
request's atom sums are added up per chunk on the host in float64 when its last step is done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pergola.text.errors import RequestError


class ChunkLimits(NamedTuple):
    """How many windows chunking may make (EngineConfig's max_text_chunks, max_request_chunks)."""

    per_text: int
    per_request: int


def window_starts(n: int, size: int, overlap: int) -> np.ndarray:
    """First token of each window of a text of `n` tokens: k·(size−overlap) while it is below
    max(n − overlap, 1). [w] int64."""
    stride = size - overlap
    return np.arange(-(-max(n - overlap, 1) // stride), dtype=np.int64) * stride


def window_count(n: int, size: int, overlap: int) -> int:
    """len(window_starts(n, size, overlap)), without the array."""
    return -(-max(n - overlap, 1) // (size - overlap))


def text_spans(offsets: np.ndarray, starts: np.ndarray, ends: np.ndarray, chars: int) -> np.ndarray:
    """[w, 2] int32 character spans of windows of tokens [starts, ends) whose tokens have
    `offsets` [n, 2]; a window of no tokens (a text of none) spans the whole text."""
    if offsets.shape[0] == 0:
        return np.array([[0, chars]] * len(starts), dtype=np.int32).reshape(-1, 2)
    return np.stack([offsets[starts, 0], offsets[ends - 1, 1]], axis=1).astype(np.int32)


def late_ranges(n: int, chunk_starts: np.ndarray, chunk_ends: np.ndarray, macro_starts: np.ndarray,
                overlap: int, sequence_starts: np.ndarray, lead: int, lengths: np.ndarray) -> np.ndarray:
    """CHUNK_SPANS rows (chunk, start, end) of one text's chunks, over the flat ids of its encoding
    windows.

    Chunk c holds text tokens [chunk_starts[c], chunk_ends[c]); encoding window j holds text tokens
    from macro_starts[j], its first text token at flat position sequence_starts[j] + lead (the
    special tokens and prompt before it). Text token t is taken from window j when
    owner[j] <= t < owner[j + 1], owner[j] = macro_starts[j] + overlap // 2 (owner[0] = 0): the
    middle of the overlap. A text of no tokens pools its one window whole (`lengths`: the windows'
    sequence lengths)."""
    if n == 0:
        return np.array([[c, sequence_starts[0], sequence_starts[0] + lengths[0]] for c in range(len(chunk_starts))],
                        dtype=np.int64).reshape(-1, 3)
    owner = np.append(macro_starts + overlap // 2, n)
    owner[0] = 0
    rows = []
    for c, (a, b) in enumerate(zip(chunk_starts.tolist(), chunk_ends.tolist())):
        j = int(np.searchsorted(owner, a, side="right")) - 1
        while j < len(macro_starts) and owner[j] < b:
            lo, hi = max(a, int(owner[j])), min(b, int(owner[j + 1]))
            if lo < hi:
                base = int(sequence_starts[j]) + lead - int(macro_starts[j])
                rows.append((c, base + lo, base + hi))
            j += 1
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


@dataclass(frozen=True)
class SpanPlan:
    """A request's CHUNK_SPANS as disjoint pieces of its flat tokens (module docstring).

    segments [T] int64: each token's atom, -1 for a token no chunk pools; an atom lies inside one
    sequence, so inside one step. ranges: the checked rows, as (chunk, first atom, end atom)."""

    segments: np.ndarray  # [T] int64
    num_atoms: int
    atom_ranges: np.ndarray  # [m, 3] int64: (chunk, first atom, end atom)
    counts: np.ndarray  # [k] int64: tokens pooled per chunk

    @property
    def num_chunks(self) -> int:
        return int(self.counts.size)

    @classmethod
    def build(cls, spans: np.ndarray, lengths: np.ndarray) -> SpanPlan:
        """From CHUNK_SPANS ([3m] or [m, 3] int64) over sequences of `lengths`; RequestError
        unless every row holds at least one token of one sequence and chunks are numbered 0..k-1."""
        if spans.size == 0 or spans.size % 3:
            raise RequestError(f"CHUNK_SPANS holds {spans.size} values; send (chunk, start, end) rows, at least one")
        rows = spans.reshape(-1, 3).astype(np.int64)
        chunk, start, end = rows[:, 0], rows[:, 1], rows[:, 2]
        bounds = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        seq = np.searchsorted(bounds, start, side="right") - 1
        inside = (start >= 0) & (end > start) & (end <= bounds[-1])
        inside &= end <= bounds[np.clip(seq + 1, 0, lengths.size)]
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise RequestError(f"CHUNK_SPANS row {i} ({start[i]}, {end[i]}) must hold at least one token of one "
                               f"sequence of the request's {int(bounds[-1])} tokens")
        k = int(chunk.max()) + 1
        if chunk.min() < 0 or np.unique(chunk).size != k:
            raise RequestError("CHUNK_SPANS' chunks must be numbered 0, 1, ... with every number used")
        cuts = np.unique(np.concatenate([start, end, bounds]))
        covered = np.zeros(int(bounds[-1]) + 1, dtype=np.int64)
        np.add.at(covered, start, 1)
        np.add.at(covered, end, -1)
        covered = np.cumsum(covered[:-1]) > 0
        segments = np.searchsorted(cuts, np.arange(int(bounds[-1])), side="right") - 1
        segments[~covered] = -1
        atom_ranges = np.stack([chunk, np.searchsorted(cuts, start), np.searchsorted(cuts, end)], axis=1)
        counts = np.bincount(chunk, weights=end - start, minlength=k).astype(np.int64)
        return cls(segments, len(cuts) - 1, atom_ranges, counts)

    def means(self, atom_sums: np.ndarray) -> np.ndarray:
        """[num_atoms, H] sums of the atoms' hidden states -> [k, H] fp32: each chunk's mean."""
        prefix = np.zeros((atom_sums.shape[0] + 1, atom_sums.shape[1]), dtype=np.float64)
        np.cumsum(atom_sums, axis=0, dtype=np.float64, out=prefix[1:])
        chunk, first, end = self.atom_ranges.T
        sums = np.zeros((self.num_chunks, atom_sums.shape[1]), dtype=np.float64)
        np.add.at(sums, chunk, prefix[end] - prefix[first])
        return (sums / self.counts[:, None]).astype(np.float32)

