"""Packing of a step into CUDA-graph buckets and static buffers, checked on the CPU.

GraphCache.key_for picks the (sequence, token) bucket of a step; StaticBuffers.fill writes the
step, padded to that bucket, into the buffers the forward reads. On the GPU both run inside
ModelRunner.step (tests/test_gpu.py compares its results with eager ones); here their output is
compared with what the unpadded CPU path (host_inputs, AttentionMetadata.build) gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pergola.engine.graphs import GraphCache, seq_buckets, token_buckets
from pergola.engine.runner import StaticBuffers, host_inputs
from pergola.layers.attention import AttentionMetadata
from pergola.outputs.pooling import pool

MAX_BATCH_SEQS = 8
MAX_SEQS = MAX_BATCH_SEQS + 1  # as ModelRunner sizes them: + the padding sequence
MAX_TOKENS = 1600  # not a multiple of a bucket step: the last bucket is MAX_TOKENS itself


def graph_cache(max_graph_tokens: int = MAX_TOKENS) -> GraphCache:
    def forward(s: int, t: int) -> None:
        raise AssertionError("key_for must not run the model")

    return GraphCache(forward, max_graph_tokens, MAX_SEQS)


@pytest.fixture
def buffers(monkeypatch: pytest.MonkeyPatch) -> StaticBuffers:
    """StaticBuffers on the CPU. Its staging buffers are pinned, which needs the CUDA driver:
    without one they are plain host memory here (fill() treats both alike)."""
    if torch.cuda.is_available():
        return StaticBuffers(MAX_TOKENS, MAX_SEQS, 4, torch.device("cpu"))
    empty = torch.empty
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", lambda *a, pin_memory=False, **kw: empty(*a, **kw))
        return StaticBuffers(MAX_TOKENS, MAX_SEQS, 4, torch.device("cpu"))


# --- buckets ---------------------------------------------------------------------------------


def test_bucket_lists():
    assert token_buckets(1600) == list(range(64, 1025, 64)) + [1280, 1536, 1600]
    assert token_buckets(1536)[-3:] == [1024, 1280, 1536]  # a multiple of the step is not repeated
    assert token_buckets(100) == [64, 100]
    assert seq_buckets(9) == [1, 2, 4, 8, 9]
    assert seq_buckets(8) == [1, 2, 4, 8]
    assert seq_buckets(1) == [1]


@pytest.mark.parametrize("num_seqs, num_tokens, key", [
    (1, 64, (1, 64)),  # fits a bucket exactly: no padding sequence
    (1, 1, (2, 64)),  # 63 padding tokens: one more sequence holds them
    (1, 65, (2, 128)),
    (3, 128, (4, 128)),
    (4, 127, (8, 128)),  # 4 + the padding sequence
    (8, 512, (8, 512)),
    (8, 511, (9, 512)),  # the padding sequence is the ninth: MAX_SEQS leaves room for it
    (2, 1024, (2, 1024)),
    (2, 1025, (4, 1280)),  # past 1024 buckets are 256 apart
    (1, 1599, (2, 1600)),
    (8, 1600, (8, 1600)),
    (1, 1601, None),  # over the largest bucket: eager
    (9, 64, (9, 64)),
    (9, 63, None),  # no bucket holds 10 sequences
])
def test_key_for(num_seqs, num_tokens, key):
    assert graph_cache().key_for(num_seqs, num_tokens) == key


def test_key_for_is_the_smallest_bucket_that_fits():
    cache = graph_cache()
    for num_seqs in range(1, MAX_BATCH_SEQS + 1):
        for num_tokens in range(num_seqs, MAX_TOKENS + 80):
            key = cache.key_for(num_seqs, num_tokens)
            if num_tokens > MAX_TOKENS:
                assert key is None, (num_seqs, num_tokens)
                continue
            # Every step the scheduler can make (at most MAX_BATCH_SEQS sequences) gets a key.
            assert key is not None, (num_seqs, num_tokens)
            s, t = key
            need = num_seqs + (t > num_tokens)
            assert t >= num_tokens and s >= need
            assert t in cache.tokens and s in cache.seqs
            assert all(b < num_tokens for b in cache.tokens if b < t)
            assert all(b < need for b in cache.seqs if b < s)


def test_key_for_is_monotonic():
    cache = graph_cache()
    for num_seqs in range(1, MAX_BATCH_SEQS + 1):
        tokens = [cache.key_for(num_seqs, n)[1] for n in range(num_seqs, MAX_TOKENS + 1)]
        assert tokens == sorted(tokens)
    for num_tokens in (8, 63, 64, 100, 1024, 1025, 1600):
        seqs = [cache.key_for(n, num_tokens)[0] for n in range(1, min(num_tokens, MAX_BATCH_SEQS) + 1)]
        assert seqs == sorted(seqs)


def test_key_for_with_a_smaller_graph_limit():
    cache = graph_cache(max_graph_tokens=256)
    assert cache.key_for(1, 256) == (1, 256)
    assert cache.key_for(1, 257) is None
    assert cache.key_for(MAX_BATCH_SEQS, 200) == (MAX_SEQS, 256)


# --- StaticBuffers.fill --------------------------------------------------------------------


def views(buf: StaticBuffers, s: int, t: int) -> dict[str, np.ndarray]:
    """What the forward of a (s, t) step reads from the buffers."""
    b = buf.inputs(s, t, max_seqlen=t, causal=False)
    return {"ids": b.input_ids.numpy().copy(), "positions": b.positions.numpy().copy(),
            "types": b.token_types.numpy().copy(), "seq_ids": b.seq_ids.numpy().copy(),
            "weights": b.token_weights.numpy().copy(), "cu": b.meta.cu_seqlens.numpy().copy()}


def expected(ids: np.ndarray, lengths: list[int], skips: list[int] | None, types: np.ndarray | None,
             s: int, t: int) -> dict[str, np.ndarray]:
    """The padded step written out by hand: real tokens, then padding sequence B, then empty ones."""
    b, n = len(lengths), len(ids)
    positions = np.concatenate([np.arange(k) for k in lengths])
    seq_ids = np.repeat(np.arange(b), lengths)
    skip_per_token = np.repeat(skips if skips is not None else [0] * b, lengths)
    pad = t - n
    cu = [0]
    for k in lengths:
        cu.append(cu[-1] + k)
    cu += [t] * (s - b)
    return {"ids": np.concatenate([ids, np.zeros(pad)]),
            "positions": np.concatenate([positions, np.zeros(pad)]),
            "types": np.concatenate([types if types is not None else np.zeros(n), np.zeros(pad)]),
            "seq_ids": np.concatenate([seq_ids, np.full(pad, b)]),
            "weights": np.concatenate([(positions >= skip_per_token).astype(np.float32), np.zeros(pad)]),
            "cu": np.array(cu)}


def fill(buf: StaticBuffers, lengths: list[int], s: int, t: int, skips: list[int] | None = None,
         with_types: bool = False, first_id: int = 100) -> dict[str, np.ndarray]:
    """Fill a step of `lengths` (ids first_id.., token types alternating 1/0) and check every view."""
    n = sum(lengths)
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    types = (np.arange(n) % 2 == 0).astype(np.int64) if with_types else None
    buf.fill(ids, np.array(lengths, dtype=np.int64), None if skips is None else np.array(skips, dtype=np.int64),
             types, s, t)
    got, want = views(buf, s, t), expected(ids, lengths, skips, types, s, t)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(buf.cu_seqlens_host.numpy(), want["cu"])  # what FlashInfer plans from
    return got


def test_fill_ragged_step_padded_to_its_bucket(buffers):
    got = fill(buffers, [3, 1, 5], s=4, t=64, skips=[1, 0, 2], with_types=True)
    # spelled out for the first tokens: three sequences, then padding sequence 3
    assert got["positions"][:10].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0]
    assert got["seq_ids"][:10].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 3]
    assert got["weights"][:10].tolist() == [0, 1, 1, 1, 0, 0, 1, 1, 1, 0]
    assert got["cu"].tolist() == [0, 3, 4, 9, 64]


def test_fill_empty_sequences_after_the_padding_one(buffers):
    got = fill(buffers, [2, 2, 2, 2, 2], s=8, t=64)
    assert got["cu"].tolist() == [0, 2, 4, 6, 8, 10, 64, 64, 64]
    assert (got["seq_ids"][10:] == 5).all()


def test_fill_without_padding(buffers):
    """An eager step (no graph key) is filled at its own size: no padding sequence."""
    got = fill(buffers, [7, 9], s=2, t=16, skips=[0, 0])
    assert got["weights"].tolist() == [1.0] * 16
    assert got["cu"].tolist() == [0, 7, 16]


def test_smaller_step_after_larger_ones_reads_no_stale_data(buffers):
    """fill() alternates two staging buffers and writes device buffers only up to (s, t): every
    element a (s, t) step reads must come from that step, whatever ran before."""
    fill(buffers, [200, 300, 100, 400, 64], s=8, t=1280, skips=[5, 1, 0, 7, 3], with_types=True, first_id=7000)
    fill(buffers, [600, 600], s=4, t=1280, skips=[10, 20], with_types=True, first_id=9000)
    fill(buffers, [2, 1], s=4, t=64)  # the first staging buffer again, last used for a larger step
    fill(buffers, [5], s=1, t=5)
    fill(buffers, [30, 3, 1, 1, 1, 1, 1, 1], s=9, t=64, skips=[2, 0, 0, 0, 0, 0, 0, 1], with_types=True)


def test_keys_and_fill_together_agree_with_the_unpadded_step(buffers):
    """As ModelRunner.step: the key's (s, t) padding, then pooling over the buffers gives the
    unpadded step's result for the real sequences, whatever the padding tokens' hidden states."""
    cache, rng = graph_cache(), np.random.default_rng(0)
    for _ in range(60):
        b = int(rng.integers(1, MAX_BATCH_SEQS + 1))
        lengths = rng.integers(1, 150, size=b)
        if lengths.sum() > MAX_TOKENS:
            continue
        n = int(lengths.sum())
        skips = rng.integers(0, 3, size=b) if rng.random() < 0.5 else None
        s, t = cache.key_for(b, n)
        fill(buffers, lengths.tolist(), s, t, None if skips is None else skips.tolist())
        padded = buffers.inputs(s, t, max_seqlen=t, causal=False)

        positions, seq_ids, weights = host_inputs(lengths, skips)
        meta = AttentionMetadata.build(lengths.tolist(), torch.device("cpu"), causal=False, padded=False)
        hidden = torch.from_numpy(rng.standard_normal((t, 6)).astype(np.float32))
        hidden[n:] = 1e6  # padding tokens' states: must not reach a real sequence
        for mode in ("mean", "cls", "last"):
            want = pool(hidden[:n], meta.cu_seqlens, torch.from_numpy(seq_ids), mode,
                        None if weights is None else torch.from_numpy(weights))
            got = pool(hidden, padded.meta.cu_seqlens, padded.seq_ids, mode, padded.token_weights)
            assert got.shape == (s, 6)
            torch.testing.assert_close(got[:b], want, rtol=1e-5, atol=1e-5, msg=mode)


def test_a_failed_capture_leaves_its_bucket_eager(monkeypatch, caplog):
    """Warm-up, then a capture that raises: the step is computed eagerly (its outputs real), the
    failure logged and counted, and the bucket never captured again; other buckets unaffected."""
    from pergola.engine import graphs

    calls: list[tuple[int, int]] = []
    captures: list[tuple[int, int]] = []

    def failing_capture(graph, fn, pool=None, stream=None, carveout=None):
        captures.append(key)
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(graphs, "capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)  # (needs a GPU; the capture is the fake above)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)  # (a CPU-only torch has none)
    cache = GraphCache(lambda s, t: calls.append((s, t)), MAX_TOKENS, MAX_SEQS)
    key = cache.key_for(3, 100)
    with caplog.at_level("WARNING", logger="pergola.graphs"):
        modes = [cache.run(key) for _ in range(4)]
    assert modes == ["warmup", "eager", "eager", "eager"]
    assert calls == [key] * 4 and captures == [key]  # every step computed; one capture tried
    assert cache.stats.failed_captures == 1 and key in cache.uncapturable and not cache.graphs
    assert "capture for 4 seqs x 128 tokens failed (RuntimeError" in caplog.text
    other = cache.key_for(1, 600)
    assert cache.run(other) == "warmup" and other not in cache.uncapturable
