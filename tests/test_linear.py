"""Matmul kernel selection (CPU): the tile table's lookup and file format, and the Triton kernels'
indexing (matmuls, the residual add, RMSNorm) run through Triton's interpreter in FP32 (BF16 dots
need a GPU: tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from pergola.layers.linear import Tile, dump_tiles, load_tiles, pick_tile, table_key, tile_rows, tiles_for
from triton_interp import run_in_interpreter


def test_pick_tile_walks_rows_in_increasing_m():
    small, mid = Tile(16, 32, 64), Tile(64, 64, 128)
    table = {table_key("plain", 1024, 2048): [(64, small), (256, None), (512, mid)]}
    rows = tile_rows(table, "plain", 1024, 2048)
    assert pick_tile(rows, 1) == small
    assert pick_tile(rows, 64) == small
    assert pick_tile(rows, 65) is None  # cuBLAS row
    assert pick_tile(rows, 300) == mid
    assert pick_tile(rows, 513) is None  # past the table: cuBLAS
    assert tile_rows(table, "gated", 1024, 2048) == ()  # another kind or shape: cuBLAS


def test_a_tile_that_does_not_divide_the_shape_is_not_used():
    table = {table_key("plain", 384, 1536): [(512, Tile(16, 256, 64))]}
    assert pick_tile(tile_rows(table, "plain", 384, 1536), 8) is None


def test_each_projection_keeps_the_rows_of_its_shape():
    from pergola.layers.linear import GateUpLinear, Linear, MergedLinear, select_tiles

    plain, gated = Tile(16, 32, 64), Tile(64, 32, 64, tma=True)
    table = {table_key("plain", 96, 64): [(64, plain)], table_key("gated", 128, 64): [(1 << 20, gated)]}
    model = torch.nn.ModuleDict({"qkv": MergedLinear(64, [32, 32, 32]), "o": Linear(96, 64),
                                 "gate_up": GateUpLinear(64, 128), "biased": Linear(64, 96, bias=True)})
    select_tiles(model, table)
    assert model["qkv"].tiles == ((64, plain),)  # plain:96x64
    assert model["gate_up"].tiles == ((1 << 20, gated),)  # gated:128x64 (I = 128 of the 256 rows)
    assert model["o"].tiles == ()  # plain:64x96 is not in the table
    assert model["biased"].tiles == ()  # plain:96x64, but no tile adds a bias
    # the CPU (and FP32) never runs a Triton tile, whatever the rows say
    assert model["qkv"].tile(torch.randn(8, 64)) is None
    select_tiles(model, {})  # "cublas"
    assert model["qkv"].tiles == ()


def test_fused_projections_load_their_parts_into_their_rows():
    from pergola.layers.linear import GateUpLinear, MergedLinear

    qkv = MergedLinear(8, [8, 4, 4], bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for i, part in enumerate((q, k, v)):
        qkv.weight.weight_loader(qkv.weight, part, i)
        qkv.bias.weight_loader(qkv.bias, part[:, 0], i)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]), rtol=0, atol=0)
    torch.testing.assert_close(qkv.bias.data, torch.cat([q, k, v])[:, 0], rtol=0, atol=0)
    x = torch.randn(3, 8)
    torch.testing.assert_close(qkv(x), x @ torch.cat([q, k, v]).t() + qkv.bias)
    with pytest.raises(ValueError, match="parts"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(16, 8))
    gate_up = GateUpLinear(8, 4)
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    torch.testing.assert_close(gate_up(x), torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()))


def test_tile_table_file_round_trip(tmp_path):
    table = {table_key("gated", 3072, 1024): [(64, Tile(64, 32, 128, pdl=True)), (128, Tile(64, 64, 128, 4, 4)),
                                              (1024, None)]}
    dump_tiles(table, str(tmp_path / "t.json"))
    assert load_tiles(str(tmp_path / "t.json")) == table
    assert tiles_for(str(tmp_path / "t.json"), torch.device("cpu")) == {}  # the CPU never uses Triton
    assert tiles_for("cublas", torch.device("cuda")) == {}


def test_linear_adds_to_the_residual_in_place():
    from pergola.layers.linear import linear

    torch.manual_seed(0)
    x, w, r = torch.randn(5, 64), torch.randn(32, 64), torch.randn(5, 32)
    residual = r.clone()
    assert linear(x, w, residual) is residual
    torch.testing.assert_close(residual, r + x @ w.t())


def test_triton_linear_refuses_an_accumulator_it_cannot_write():
    pytest.importorskip("triton")
    from pergola.layers.linear import triton_linear

    x, w = torch.randn(4, 64), torch.randn(64, 64)
    with pytest.raises(ValueError, match="out="):
        triton_linear(x, w, Tile(16, 32, 64), gated=True, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="out="):
        triton_linear(x, w, Tile(16, 32, 64), out=torch.empty(64, 4).t())


def test_a_split_tile_refuses_partials_past_its_int32_offsets():
    pytest.importorskip("triton")
    from pergola.layers.linear import triton_linear

    x, w = torch.empty(32768, 128, dtype=torch.bfloat16), torch.empty(4096, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split-K is for small M"):  # 8 x 2 x 32,768 x 4,096 = 2^31 partials
        triton_linear(x, w, Tile(16, 32, 16, split=8))


def test_a_dependent_launch_tile_runs_on_the_pointer_kernel_of_a_gpu_only():
    pytest.importorskip("triton")
    from pergola.layers.linear import triton_linear

    assert str(Tile(64, 32, 128, split=2, pdl=True)) == "64x32x128/w4s4/k2/pdl"
    with pytest.raises(ValueError, match="pointer kernel"):
        Tile(128, 128, 64, tma=True, pdl=True)
    x, w = torch.randn(16, 128, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dependent launch needs"):  # griddepcontrol is PTX: no interpreter
        triton_linear(x, w, Tile(16, 32, 64, pdl=True))


def test_engine_config_refuses_a_missing_tile_file(tmp_path):
    from pergola.config.engine import EngineConfig

    with pytest.raises(ValueError, match="matmul"):
        EngineConfig(model_dir=str(tmp_path), matmul=str(tmp_path / "nope.json"))


KERNEL_CHECK = """
import torch, torch.nn.functional as F
from pergola.layers.fused import silu_and_mul_ref
from pergola.layers.linear import Tile, triton_linear
torch.manual_seed(0)
for m in (1, 45, 100):
    x = torch.randn(m, 256); w = torch.randn(192, 256) * 0.06
    # the TMA tiles: persistent programs (3 on the CPU) each walking several output tiles
    for tile in (Tile(16, 32, 64), Tile(32, 64, 128), Tile(16, 32, 64, tma=True), Tile(32, 32, 128, tma=True),
                 Tile(16, 32, 64, split=2), Tile(32, 32, 64, split=4)):
        torch.testing.assert_close(triton_linear(x, w, tile), F.linear(x, w), atol=1e-4, rtol=1e-4)
        if tile.fits(96, 256):  # gated: 96 output columns (gate | up = 192 rows of w)
            torch.testing.assert_close(triton_linear(x, w, tile, gated=True),
                                       silu_and_mul_ref(F.linear(x, w)), atol=1e-4, rtol=1e-4)
        r = torch.randn(m, 192)  # the residual add in the epilogue, in place
        out = r.clone()
        assert triton_linear(x, w, tile, out=out) is out
        torch.testing.assert_close(out, r + F.linear(x, w), atol=1e-4, rtol=1e-4)
# the RMSNorm that reads the residual stream (a row of 96 in a 128-wide masked block)
from pergola.layers.fused import launch_rms_norm, rms_norm_ref
x, w = torch.randn(7, 96), torch.rand(96) + 0.5
torch.testing.assert_close(launch_rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)
torch.testing.assert_close(launch_rms_norm(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), atol=1e-5, rtol=1e-5)
# folded norms: the kernels after a matmul on the raw stream apply its 1/rms per row (PendingNorm)
from pergola.layers.fused import (PendingNorm, launch_act_and_mul, launch_qk_norm_rope, qk_norm_rope_ref,
                                  rms_norm_ref)
for m in (1, 45):
    x = torch.randn(m, 256) * 7; w = torch.randn(192, 256) * 0.06
    pending = PendingNorm(x, 1e-6)
    want = silu_and_mul_ref(F.linear(rms_norm_ref(x, None, 1e-6), w))
    torch.testing.assert_close(silu_and_mul_ref(F.linear(x, w), pending), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(launch_act_and_mul(F.linear(x, w), "silu", pending), want, atol=1e-4, rtol=1e-4)
    # the gated pointer kernel's sum of squares over K (split-K: by the program that adds the slices)
    for tile in (Tile(16, 32, 64), Tile(32, 32, 128), Tile(16, 32, 64, split=4)):
        torch.testing.assert_close(triton_linear(x, w, tile, gated=True, norm_eps=1e-6), want, atol=1e-4, rtol=1e-4)
    heads, kv, d = 4, 2, 32
    wqkv = torch.randn((heads + 2 * kv) * d, 256) * 0.06
    qw, kw = torch.rand(d) + 0.5, torch.rand(d) + 0.5
    angles = torch.arange(64)[:, None] * (1e-4 ** (torch.arange(0, d, 2) / d))
    cos, sin, pos = angles.cos(), angles.sin(), torch.randint(0, 64, (m,))
    ref = qk_norm_rope_ref(F.linear(rms_norm_ref(x, None, 1e-6), wqkv), qw, kw, cos, sin, pos, heads, kv, d, 1e-6)
    got = launch_qk_norm_rope(F.linear(x, wqkv), qw, kw, cos, sin, pos, heads, kv, d, 1e-6, pending)
    twin = qk_norm_rope_ref(F.linear(x, wqkv), qw, kw, cos, sin, pos, heads, kv, d, 1e-6, pending)
    for a, b, c in zip(got, ref, twin):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(c, b, atol=1e-4, rtol=1e-4)
# RoPE without norms, in place on views of a qkv product with a row stride (12 q heads: a masked block)
from pergola.layers.fused import ACTIVATIONS, act_and_mul_ref, launch_act_and_mul, launch_rope_qk, rope_ref, split_qkv
for heads, kv, d in ((12, 12, 64), (4, 2, 32)):
    qkv = torch.randn(9, (heads + 2 * kv) * d)
    q, k, v = split_qkv(qkv, heads, kv, d)
    angles = torch.arange(64)[:, None] * (1e-4 ** (torch.arange(0, d, 2) / d))
    cos, sin, pos = angles.cos(), angles.sin(), torch.randint(0, 64, (9,))
    want_q, want_k, want_v = rope_ref(q, cos, sin, pos), rope_ref(k, cos, sin, pos), v.clone()
    got_q, got_k = launch_rope_qk(q, k, cos, sin, pos)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, :heads * d].view(9, heads, d), want_q)  # in place
    assert torch.equal(v, want_v)
# the GLU with every activation: 1,500 columns (two column blocks, the second masked) and ModernBERT's
# 1,152 ([8, 128] tiles over 13 rows, the last tile's rows masked)
from pergola.layers.fused import glu_tile
assert glu_tile(1500, False) == (1, 1024) and glu_tile(1152, False) == (8, 128) and glu_tile(1152, True) == (1, 1024)
assert glu_tile(3072, False) == (1, 1024) and glu_tile(96, False) == (1, 128)
for g in (torch.randn(5, 3000) * 3, torch.randn(13, 2304) * 3):
    for act in ACTIVATIONS:
        torch.testing.assert_close(launch_act_and_mul(g, act), act_and_mul_ref(g, act), atol=1e-5, rtol=1e-5)
# LayerNorm with a matmul's bias still to add (a row of 96 in a 128-wide masked block), with and without bias
from pergola.layers.fused import launch_layer_norm, layer_norm_ref
x, w, b, pre = torch.randn(7, 96) * 3 + 1, torch.rand(96) + 0.5, torch.randn(96), torch.randn(96)
for bias, pre_bias in ((b, pre), (None, None), (b, None)):
    torch.testing.assert_close(launch_layer_norm(x, w, bias, 1e-12, pre_bias), layer_norm_ref(x, w, bias, 1e-12, pre_bias),
                               atol=1e-5, rtol=1e-5)
# the module ModernBERT builds: nn.LayerNorm's state dict, the kernel's forward (routed as on CUDA)
import pergola.layers.fused as fused
fused.use_triton = lambda t: True
for with_bias in (False, True):
    ref = torch.nn.LayerNorm(96, eps=1e-5, bias=with_bias)
    torch.nn.init.uniform_(ref.weight, 0.5, 1.5)
    ln = fused.LayerNorm(96, eps=1e-5, bias=with_bias)
    ln.load_state_dict(ref.state_dict())
    torch.testing.assert_close(ln(x), ref(x), atol=1e-5, rtol=1e-5)
# split-K: the counters a projection keeps are left at zero for its next call, and too few are refused
from pergola.layers.linear import split_counters
tile = Tile(16, 32, 64, split=4)
counters = split_counters(((64, Tile(16, 32, 64)), (128, tile)), 96, torch.device("cpu"))
assert counters.tolist() == [0] * 24  # 128 / 16 row tiles x 96 / 32 column tiles
xs, ws = torch.randn(100, 256), torch.randn(96, 256) * 0.06
for _ in range(2):
    torch.testing.assert_close(triton_linear(xs, ws, tile, counters=counters), F.linear(xs, ws), atol=1e-4, rtol=1e-4)
    assert counters.tolist() == [0] * 24
try:
    triton_linear(torch.randn(129, 256), ws, tile, counters=counters)
    raise AssertionError("27 tiles on 24 counters")
except ValueError as e:
    assert "needs 27 int32 counters" in str(e)
print("ok")
"""


def test_triton_kernel_indexing_in_the_interpreter():
    run_in_interpreter(KERNEL_CHECK)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_an_activated_projection_is_the_activation_of_the_projection_off_the_gpu(act):
    from pergola.layers.fused import ACTIVATIONS
    from pergola.layers.linear import Linear

    torch.manual_seed(0)
    dense = Linear(64, 96, bias=True)
    torch.nn.init.normal_(dense.weight, std=0.2)
    torch.nn.init.normal_(dense.bias)
    x = torch.randn(7, 64)
    # CPU (and FP32 anywhere): the model's own activation, exact GELU for "gelu"; the cuBLASLt epilogue is
    # 16-bit CUDA only (tests/test_gpu.py::test_gelu_epilogue_matches_the_exact_activation)
    torch.testing.assert_close(dense.activated(x, act), ACTIVATIONS[act](dense(x)), rtol=0, atol=0)

