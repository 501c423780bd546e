"""The L2 prefetch of small steps' weights (pergola.layers.prefetch): its window, and the call order
it relies on. The kernel itself and its effect on a model's outputs are GPU tests (tests/test_gpu.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pergola.config.engine import EngineConfig
from pergola.engine import Engine
from pergola.layers.linear import Linear
from pergola.layers.prefetch import L2Prefetch, prefetch_modules, window_plan
from test_architectures import embed

MB = 1 << 20
# Qwen3-0.6B's projections in BF16, one layer: q|k|v, o, gate|up, down
QWEN3_LAYER = [8 * MB, 4 * MB, 12 * MB, 6 * MB]


def window_bytes(sizes: list[int], at_start: list[int], at: list[list[int]], running: int) -> int:
    """Bytes asked for and not yet read once matmul `running` has been launched (its own excluded)."""
    asked = at_start + [j for row in at[:running + 1] for j in row]
    return sum(sizes[j] for j in asked if j > running)


def test_each_weight_is_asked_for_once_before_its_matmul_and_the_window_fits():
    sizes = QWEN3_LAYER * 4
    budget = 24 * MB
    at_start, at = window_plan(sizes, budget)
    asked = at_start + [j for row in at for j in row]
    assert sorted(asked) == list(range(len(sizes)))  # each once
    assert at_start == [0, 1, 2]  # 24 MB: q|k|v, o, gate|up
    for i, row in enumerate(at):
        assert all(j > i for j in row), f"matmul {i} asks for a weight already read: {row}"
        assert window_bytes(sizes, at_start, at, i) <= budget
    # every weight but the first three is asked for at least one matmul ahead of its own
    first_asked = {j: i for i, row in enumerate(at) for j in row}
    assert all(first_asked[j] < j for j in first_asked)


def test_weights_over_the_budget_are_skipped_without_holding_the_window():
    sizes = [4 * MB, 40 * MB, 4 * MB, 4 * MB]
    at_start, at = window_plan(sizes, 10 * MB)
    asked = at_start + [j for row in at for j in row]
    assert 1 not in asked
    assert sorted(asked) == [0, 2, 3]
    assert at_start == [0, 2]  # the 40 MB weight neither counts nor blocks the ones after it


def test_a_budget_under_every_weight_asks_for_nothing():
    at_start, at = window_plan(QWEN3_LAYER, MB)
    assert at_start == [] and all(row == [] for row in at)


def _folders(root: Path) -> dict[str, Path]:
    import pergola_testing as testing

    return {
        "bert": testing.make_cross_encoder_folder(root / "bert"),
        "xlm-roberta": testing.make_bge_m3_folder(root / "xlmr"),
        "mpnet": testing.make_mpnet_folder(root / "mpnet"),
        "qwen2": testing.make_qwen2_folder(root / "qwen2"),
        "gemma3": testing.make_gemma3_folder(root / "gemma3"),
        "modernbert": testing.make_modernbert_folder(root / "modernbert"),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _folders(tmp_path_factory.mktemp("prefetch"))


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "mpnet", "qwen2", "gemma3", "modernbert"])
def test_projections_run_in_registration_order(folders, kind):
    """The window is planned in registration order; a step must launch the matmuls in that order,
    each once, or a weight is asked for after its matmul (or never)."""
    engine = Engine(EngineConfig(model_dir=str(folders[kind]), dtype="float32", device="cpu"))
    modules = prefetch_modules(engine.runner.transformer_layers(), Linear)
    assert modules, "no projections found in the transformer layers"
    calls: list[int] = []
    for i, module in enumerate(modules):
        module.prefetch_hook = lambda i=i: calls.append(i)
    embed(engine, ["one short text"])
    assert calls == list(range(len(modules)))


def test_qwen3_projections_run_in_registration_order(tmp_path):
    import pergola_testing as testing

    try:
        folder = testing.make_qwen3_folder(tmp_path / "qwen3")
    except testing.TokenizerUnavailable as e:
        pytest.skip(f"the real Qwen3 tokenizer is not available: {e}")
    engine = Engine(EngineConfig(model_dir=str(folder), dtype="float32", device="cpu"))
    modules = prefetch_modules(engine.runner.transformer_layers(), Linear)
    assert len(modules) == 4 * engine.spec.hf_config["num_hidden_layers"]
    calls: list[int] = []
    for i, module in enumerate(modules):
        module.prefetch_hook = lambda i=i: calls.append(i)
    embed(engine, ["one short text"])
    assert calls == list(range(len(modules)))


def test_prefetch_plans_over_the_modules_and_stays_off_on_the_cpu(folders):
    engine = Engine(EngineConfig(model_dir=str(folders["modernbert"]), dtype="float32", device="cpu"))
    assert engine.runner.prefetch is None  # no side stream, no kernel on the CPU
    modules = prefetch_modules(engine.runner.transformer_layers(), Linear)
    prefetch = L2Prefetch(modules, budget=1 << 30)
    total = sum(m.weight.numel() * m.weight.element_size() for m in modules)
    assert prefetch.prefetched_bytes == total  # everything fits one window
    assert prefetch.at_start == list(range(len(modules)))
    with prefetch.step(False):  # off: no launch, so nothing that needs CUDA
        embed(engine, ["one short text"])
    assert prefetch.launches == 0


def test_option_is_refused_below_zero(folders):
    with pytest.raises(ValueError, match="l2_prefetch_tokens"):
        EngineConfig(model_dir=str(folders["bert"]), l2_prefetch_tokens=-1)
