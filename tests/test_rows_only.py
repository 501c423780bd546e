"""The last layer on the pooled rows only (EngineConfig.prune_last_layer): CLS- and last-token-pooled
models compute the last layer's keys and values from every token and the rest from the pooled row
alone. The vectors must equal those of every row computed, whatever shares the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pergola.config.engine import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.layers.attention import attend_rows
from pergola_testing import (
    make_bge_m3_folder,
    make_cross_encoder_folder,
    make_modernbert_folder,
    make_qwen2_folder,
    make_qwen3_folder,
    make_qwen3_reranker_folder,
    make_xlm_roberta_folder,
)


def ragged(lengths: list[int], seed: int = 1) -> EncodeRequest:
    rng = np.random.default_rng(seed)
    lens = np.array(lengths, np.int32)
    return EncodeRequest(rng.integers(5, 200, int(lens.sum())).astype(np.int64), lens)


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence's one query row [Hq, D] through SDPA over that sequence's keys alone."""
    out, start = [], 0
    for i, n in enumerate(lengths):
        kk, vv = (x[start:start + n].transpose(0, 1) for x in (k, v))  # [Hkv, n, D]
        out.append(F.scaled_dot_product_attention(q[i][:, None], kk, vv, enable_gqa=True)[:, 0])
        start += n
    return torch.stack(out)


def test_attend_rows_equals_attention_over_each_sequence_alone():
    """GQA (8 query heads on 2 key/value heads), ragged lengths; an empty sequence (a graph bucket's
    padding) gives a finite row that no other row depends on."""
    torch.manual_seed(0)
    lengths = [5, 1, 17, 0, 9]
    t = sum(lengths)
    q, k, v = torch.randn(len(lengths), 8, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    got = attend_rows(q, k, v, cu, max(lengths))
    assert got.shape == (5, 8, 16) and torch.isfinite(got).all()
    real = [i for i, n in enumerate(lengths) if n]
    want = reference_rows(q[real], k, v, [lengths[i] for i in real])
    torch.testing.assert_close(got[real], want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rows-only")
    return {
        "qwen3 (last token, causal)": make_qwen3_folder(d / "qwen3"),
        "qwen2 (last token, its norms unfolded)": make_qwen2_folder(d / "qwen2"),
        "xlm-roberta (cls)": make_xlm_roberta_folder(d / "xlmr"),
        "modernbert (cls)": make_modernbert_folder(d / "modernbert"),
        "bert cross-encoder (cls)": make_cross_encoder_folder(d / "ce"),
        "qwen3 reranker (last token)": make_qwen3_reranker_folder(d / "qwen3-reranker"),
        "bge-m3 (cls, token heads)": make_bge_m3_folder(d / "m3"),
    }


def count_attend_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of attend_rows in every model module that imports it."""
    import pergola.models.bert as bert
    import pergola.models.modernbert as modernbert
    import pergola.models.qwen3 as qwen3

    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return attend_rows(*args, **kwargs)

    for module in (bert, modernbert, qwen3):
        monkeypatch.setattr(module, "attend_rows", counted)
    return calls


@pytest.mark.parametrize("kind", ["qwen3 (last token, causal)", "qwen2 (last token, its norms unfolded)",
                                  "xlm-roberta (cls)", "modernbert (cls)",
                                  "bert cross-encoder (cls)", "qwen3 reranker (last token)",
                                  "bge-m3 (cls, token heads)"])
def test_the_pooled_rows_last_layer_equals_every_row_computed(folders, kind, monkeypatch):
    calls = count_attend_rows(monkeypatch)
    pruned = Engine(EngineConfig(model_dir=str(folders[kind]), prune_last_layer=True))
    full = Engine(EngineConfig(model_dir=str(folders[kind]), prune_last_layer=False))
    assert pruned.runner.rows_only and not full.runner.rows_only
    req = ragged([40, 7, 1, 33, 12])
    got = pruned.encode([req])[0]
    assert len(calls) == 1  # one step, its last layer
    want = full.encode([ragged([40, 7, 1, 33, 12])])[0]
    assert len(calls) == 1
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)
    # A text's vector does not depend on its neighbours in the step.
    text, before, after = (ragged([n], seed=9 + n).input_ids for n in (33, 5, 60))
    beside = EncodeRequest(np.concatenate([before, text, after]), np.array([5, 33, 60], np.int32))
    alone = full.encode([EncodeRequest(text, np.array([33], np.int32))])[0][0]
    np.testing.assert_allclose(pruned.encode([beside])[0][1], alone, atol=1e-5, rtol=1e-4)


def with_token_rows(engine: Engine, lengths: list[int]) -> EncodeRequest:
    """A request that asks for every column of bge-m3's per-token rows."""
    req = ragged(lengths)
    req.token_rows = np.empty((int(req.lengths.sum()), engine.runner.token_width), np.float32)
    return req


def test_a_step_that_returns_token_rows_computes_every_row(folders, monkeypatch):
    """bge-m3: sparse / ColBERT rows need every token's last state, so such a step runs the whole last
    layer (its rows equal the unpruned engine's); its dense vector equals the pruned step's."""
    calls = count_attend_rows(monkeypatch)
    folder = str(folders["bge-m3 (cls, token heads)"])
    engine = Engine(EngineConfig(model_dir=folder, prune_last_layer=True))
    full = Engine(EngineConfig(model_dir=folder, prune_last_layer=False))
    req, want = with_token_rows(engine, [12, 30]), with_token_rows(full, [12, 30])
    with_rows = engine.encode([req])[0]
    assert not calls
    full.encode([want])
    np.testing.assert_allclose(req.token_rows, want.token_rows, atol=1e-6, rtol=1e-6)
    dense_only = engine.encode([ragged([12, 30])])[0]
    assert len(calls) == 1
    np.testing.assert_allclose(dense_only, with_rows, atol=1e-5, rtol=1e-4)


def test_models_whose_pooled_row_does_not_see_every_token_keep_the_whole_layer(tmp_path):
    """Mean pooling reads every row; a causal model's first token sees itself alone (attend_rows
    gives a row its whole sequence); ModernBERT's sliding last layer has a window attend_rows lacks."""
    mean = make_qwen3_folder(tmp_path / "mean", variant="bidirectional-mean")
    assert not Engine(EngineConfig(model_dir=str(mean), prune_last_layer=True)).runner.rows_only
    causal = Engine(EngineConfig(model_dir=str(make_qwen3_folder(tmp_path / "causal"))))
    assert causal.runner.model.takes_rows("last") and not causal.runner.model.takes_rows("cls")
    modernbert = Engine(EngineConfig(model_dir=str(make_modernbert_folder(tmp_path / "mb"))))
    modernbert.runner.model.layers[-1].layer_type = "sliding_attention"
    assert not modernbert.runner.model.takes_rows("cls")


@pytest.mark.gpu
def test_on_a_gpu_attend_rows_flash_kernel_equals_the_masked_scores():
    """BF16 on CUDA goes through FlashAttention-2's varlen kernel with one query per sequence; the
    fp32 masked-score path is the reference (Qwen3-0.6B's 16 / 8 heads of 128)."""
    torch.manual_seed(0)
    lengths = [300, 1, 4096, 77]
    t = sum(lengths)
    q = torch.randn(len(lengths), 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")
    got = attend_rows(q, k, v, cu, max(lengths)).float()
    want = attend_rows(q.float(), k.float(), v.float(), cu, max(lengths))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[100, 7, 33, 5, 2], [512] * 12], ids=["graph step", "eager step"])
def test_on_a_gpu_the_pooled_rows_last_layer_equals_every_row(tmp_path_factory, lengths):
    """Qwen3-0.6B's shape in BF16, a graph step (its bucket pads two empty sequences) and one over the
    graph crossover (6,144 tokens): the pruned last layer gives the vectors of the whole one."""
    from conftest import cosine_rows, qwen3_folders_or_skip

    folder = qwen3_folders_or_skip(tmp_path_factory.mktemp("rows-gpu"), "qwen3-0.6b", "bfloat16")["causal-last"]
    pruned = Engine(EngineConfig(model_dir=str(folder), device="cuda:0", prune_last_layer=True))
    full = Engine(EngineConfig(model_dir=str(folder), device="cuda:0", prune_last_layer=False))
    want = full.encode([ragged(lengths)])[0]
    modes = []
    for _ in range(3):  # warm-up, capture, replay on graph steps: each must match
        assert cosine_rows(pruned.encode([ragged(lengths)])[0], want).min() >= 0.9999
        modes.append(pruned.runner.last_mode)
    graph_step = sum(lengths) <= pruned.cfg.cuda_graph_max_tokens
    assert modes == (["warmup", "capture", "replay"] if graph_step else ["eager"] * 3)


@pytest.mark.gpu
def test_on_a_gpu_bge_m3_graph_steps_with_and_without_token_rows(folders):
    """bge-m3 pruned: a graph step without per-token rows (its last layer on the pooled rows) and one with
    them are graphs of their own; each, warmed up, captured and replayed, equals the whole layer's
    step (BF16), and the token rows equal the unpruned engine's."""
    folder = str(folders["bge-m3 (cls, token heads)"])
    pruned = Engine(EngineConfig(model_dir=folder, device="cuda:0", dtype="bfloat16", prune_last_layer=True))
    full = Engine(EngineConfig(model_dir=folder, device="cuda:0", dtype="bfloat16", prune_last_layer=False))

    def run(engine: Engine, token_rows: bool) -> tuple[np.ndarray, np.ndarray | None]:
        req = with_token_rows(engine, [12, 30, 5]) if token_rows else ragged([12, 30, 5])
        return engine.encode([req])[0], req.token_rows

    for token_rows in (False, True):
        want, want_rows = run(full, token_rows)
        for _ in range(3):  # warm-up, capture, replay: each must match
            got, got_rows = run(pruned, token_rows)
            np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
            if token_rows:
                np.testing.assert_allclose(got_rows, want_rows, atol=1e-3, rtol=1e-3)
    keys = pruned.runner.lanes[0].graphs.stats.keys
    assert {key[2] for key in keys} == {False, True} and len({key[:2] for key in keys}) == 1


@pytest.mark.parametrize("kind", ["qwen3 (last token, causal)", "xlm-roberta (cls)"])
def test_the_pooled_rows_last_layer_in_fp8(folders, kind, monkeypatch):
    """Every layer in FP8 (fp8_bf16_layers=0), the last one pruned: per-token scales make a row's
    quantization its own, so the pooled rows equal every row computed within BF16's rounding. The
    FP8 product is emulated in fp32 on the CPU; the refusal is lifted for the test only."""
    import pergola.models.loader

    monkeypatch.setattr(pergola.models.loader, "check_supported", lambda device, dtype: None)
    calls = count_attend_rows(monkeypatch)
    common = {"model_dir": str(folders[kind]), "dtype": "bfloat16", "quantization": "fp8", "fp8_bf16_layers": 0}
    pruned = Engine(EngineConfig(**common, prune_last_layer=True))
    full = Engine(EngineConfig(**common, prune_last_layer=False))
    assert pruned.runner.rows_only
    fp8 = {name for name, p in pruned.runner.model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert len(fp8) >= 4 * pruned.spec.hf_config["num_hidden_layers"], sorted(fp8)  # the last layer's too
    got = pruned.encode([ragged([40, 7, 1, 33, 12])])[0]
    assert len(calls) == 1
    want = full.encode([ragged([40, 7, 1, 33, 12])])[0]
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.999, cos
