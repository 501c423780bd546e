"""GPU engine: BF16 against the FP32 reference, graphs against eager, backends against each other.

Marked `gpu`: skipped without CUDA; run on the GPU machine (see README).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import BF16_ATOL, TEXTS, cosine_rows, qwen3_folders_or_skip
from pergola.config.engine import EngineConfig
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.pooling import finish
from pergola.text.tokenization import TextTokenizer

pytestmark = pytest.mark.gpu


def embed(engine: Engine, texts: list[str]) -> np.ndarray:
    enc = TextTokenizer(engine.spec).encode(texts)
    return finish(engine.encode([EncodeRequest(enc.input_ids, enc.lengths)])[0], 0, engine.spec.normalize)


@pytest.fixture(scope="module")
def gpu_engine(minilm_folder) -> Engine:
    return Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda"))


def test_bf16_matches_reference(gpu_engine, reference):
    assert gpu_engine.runner.dtype == torch.bfloat16
    assert cosine_rows(embed(gpu_engine, TEXTS), reference).min() >= 0.999


def test_fp32_on_gpu_matches_reference_tightly(minilm_folder, reference):
    eng = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", dtype="float32"))
    assert cosine_rows(embed(eng, TEXTS), reference).min() >= 0.9999


def test_lazy_capture_then_replay_equals_eager(minilm_folder):
    eager = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", enforce_eager=True))
    graphed = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda"))
    expected = embed(eager, TEXTS)
    modes = []
    for _ in range(3):  # first use: eager warm-up; second: capture; third: replay
        out = embed(graphed, TEXTS)
        modes.append(graphed.runner.last_mode)
        assert cosine_rows(out, expected).min() >= 0.9999
    assert modes == ["warmup", "capture", "replay"]
    stats = graphed.runner.graphs.stats
    assert (stats.eager_warmups, stats.captures, stats.replays) == (1, 1, 1)


def test_capture_on_a_thread_that_never_ran_a_matmul(minilm_folder):
    """A step warmed up on one thread and captured on another (execute()'s thread answers a lone
    query at once, the encode loop's thread captures the same bucket next): the capturing thread's
    first matmul must not be the captured one (cublasCreate inside a capture invalidates it)."""
    import threading

    eager = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", enforce_eager=True))
    graphed = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda"))
    expected = embed(eager, TEXTS)
    embed(graphed, TEXTS)  # warm-up, on this thread
    results: list = []

    def on_a_new_thread() -> None:
        try:
            results.append((embed(graphed, TEXTS), graphed.runner.last_mode))
        except Exception as e:  # noqa: BLE001 - reported below
            results.append(e)

    worker = threading.Thread(target=on_a_new_thread)
    worker.start()
    worker.join()
    assert not isinstance(results[0], Exception), results[0]
    out, mode = results[0]
    assert mode == "capture"
    assert cosine_rows(out, expected).min() >= 0.9999
    assert cosine_rows(embed(graphed, TEXTS), expected).min() >= 0.9999  # replay on this thread


def test_batched_equals_single_on_gpu(gpu_engine):
    batched = embed(gpu_engine, TEXTS)
    singles = np.concatenate([embed(gpu_engine, [t]) for t in TEXTS])
    assert cosine_rows(batched, singles).min() >= 0.9999
    assert np.abs(batched - singles).max() <= BF16_ATOL


@pytest.mark.parametrize("backend", ["torch_flash", "sdpa"])
def test_attention_backends_agree(minilm_folder, reference, backend):
    eng = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", attention_backend=backend,
                              enforce_eager=True))
    assert cosine_rows(embed(eng, TEXTS), reference).min() >= 0.999


def test_large_request_over_graph_crossover_runs_eagerly(minilm_folder):
    eng = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", cuda_graph_max_tokens=256))
    out = embed(eng, TEXTS * 4)
    assert eng.stats["steps_eager"] >= 1  # the ~1,900-token step is over the 256-token crossover
    eager = Engine(EngineConfig(model_dir=str(minilm_folder), device="cuda", enforce_eager=True))
    assert cosine_rows(out, embed(eager, TEXTS * 4)).min() >= 0.9999


# --- Qwen3-Embedding-0.6B shape (seeded random weights, real tokenizer) -------------------------
@pytest.fixture(scope="module")
def qwen3_folders(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return qwen3_folders_or_skip(tmp_path_factory.mktemp("qwen3-gpu"), "qwen3-0.6b", "bfloat16")


def embed_prompt(engine: Engine, texts: list[str], prompt: str | None) -> np.ndarray:
    enc = TextTokenizer(engine.spec).encode(texts, prompt_name=prompt)
    pooled = engine.encode([EncodeRequest(enc.input_ids, enc.lengths, enc.prompt_lengths)])[0]
    return finish(pooled, 0, engine.spec.normalize)


@pytest.mark.parametrize("prompt", [None, "query"])
def test_qwen3_0_6b_bf16_matches_sentence_transformers(qwen3_folders, prompt):
    from sentence_transformers import SentenceTransformer

    folder = qwen3_folders["causal-last"]
    st = SentenceTransformer(str(folder), device="cuda", model_kwargs={"dtype": torch.float32})
    ref = st.encode(TEXTS, prompt_name=prompt, batch_size=len(TEXTS))
    engine = Engine(EngineConfig(model_dir=str(folder), device="cuda"))
    for _ in range(3):  # warm-up, capture, replay: every mode must match
        assert cosine_rows(embed_prompt(engine, TEXTS, prompt), ref).min() >= 0.999
    single = np.concatenate([embed_prompt(engine, [t], prompt) for t in TEXTS])
    assert cosine_rows(single, ref).min() >= 0.999


def test_qwen3_0_6b_bidirectional_mean_matches_transformers(qwen3_folders):
    from test_qwen3 import _transformers_mean

    folder = qwen3_folders["bidirectional-mean"]
    ref = _transformers_mean(folder, TEXTS, bidirectional=True)
    engine = Engine(EngineConfig(model_dir=str(folder), device="cuda"))
    assert cosine_rows(embed_prompt(engine, TEXTS, None), ref).min() >= 0.999


def graphed_steps_match(folder, backend: str, ref: Engine) -> Engine:
    """Random 5-text requests through `backend` with graphs match `ref`; graphs were captured and replayed."""
    # A small token budget splits each request into several pipelined steps.
    eng = Engine(EngineConfig(model_dir=str(folder), device="cuda", attention_backend=backend,
                              max_batch_tokens=192))
    rng = np.random.default_rng(0)
    for _ in range(8):
        texts = [TEXTS[i] for i in rng.choice(len(TEXTS), size=5, replace=False)]
        assert cosine_rows(embed(eng, texts), embed(ref, texts)).min() >= 0.999
    stats = eng.runner.graphs.stats
    assert stats.replays > 0 and stats.captures > 0
    return eng


@pytest.mark.parametrize("backend", ["flashinfer_fa2", "flashinfer_fa3"])
def test_flashinfer_inside_graphs_matches_eager(qwen3_folders, backend):
    """Replays of one bucket with different lengths re-plan FlashInfer into the same buffers."""
    pytest.importorskip("flashinfer")
    folder = qwen3_folders["causal-last"]
    ref = Engine(EngineConfig(model_dir=str(folder), device="cuda", enforce_eager=True))
    eng = graphed_steps_match(folder, backend, ref)
    assert len(eng.runner.attn.graphed) >= len(eng.runner.graphs.stats.keys)


@pytest.mark.parametrize("kind", ["causal-last", "bidirectional-mean"])
@pytest.mark.parametrize("backend", ["flash_attn4", "triton"])
def test_backend_eager_and_graphs_match_torch_flash(qwen3_folders, kind, backend):
    """FlashAttention-4 (scripts/gpu_bundle.py --with-fa4) and pergola's Triton kernel: warm-up
    (eager), capture and replay of padded graph buckets (empty padding sequences, max_seqlen = the
    bucket's tokens), and eager steps above the crossover, against PyTorch's FA2 run eagerly."""
    if backend == "flash_attn4":
        pytest.importorskip("flash_attn.cute")
        from pergola.layers.attention import FlashAttention4

        if torch.cuda.get_device_capability()[0] not in FlashAttention4.SUPPORTED_MAJORS:
            pytest.skip("flash_attn4 needs a Hopper or Blackwell GPU")
    folder = qwen3_folders[kind]
    ref = Engine(EngineConfig(model_dir=str(folder), device="cuda", attention_backend="torch_flash",
                              enforce_eager=True))
    graphed_steps_match(folder, backend, ref)
    big = Engine(EngineConfig(model_dir=str(folder), device="cuda", attention_backend=backend,
                              cuda_graph_max_tokens=64))
    assert cosine_rows(embed(big, TEXTS), embed(ref, TEXTS)).min() >= 0.999
    assert big.stats["steps_eager"] >= 1


def test_auto_attention_probes_available_kernels(qwen3_folders):
    from pergola.layers.attention_probe import candidates

    engine = Engine(EngineConfig(model_dir=str(qwen3_folders["causal-last"]), device="cuda"))
    probe = engine.runner.probe
    assert probe is not None and probe.graph in candidates(128, torch.bfloat16)
    assert engine.runner.attn.name == probe.graph and engine.runner.eager_attn.name == probe.eager
    for tokens, name in probe.graph_rules:  # each graph step class runs the kernel chosen for it
        assert engine.runner.graph_backend(tokens).name == name
    if len(probe.backends) > 1:
        assert all(us > 0 for timings in probe.micros.values() for us in timings.values())
    # Steps of every class (graph warm-up, capture, replay; then eager) agree with the reference kernel.
    ref = Engine(EngineConfig(model_dir=str(qwen3_folders["causal-last"]), device="cuda",
                              attention_backend="torch_flash", enforce_eager=True))
    long_texts = [" ".join(TEXTS) * 3]  # ~1-2k tokens: another graph class than the short texts
    for texts in (TEXTS, long_texts):
        for _ in range(3):
            assert cosine_rows(embed(engine, texts), embed(ref, texts)).min() >= 0.999


# --- fused kernels against their PyTorch references ------------------------------------------
def test_fused_kernels_match_references():
    from pergola.layers import fused

    torch.manual_seed(0)
    t, h, heads, kv, d, inter = 300, 1024, 16, 8, 128, 3072
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(t, h, **bf), torch.rand(h, **bf) + 0.5
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm_ref(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    qkv = torch.randn(t, (heads + 2 * kv) * d, **bf)
    qw, kw = torch.rand(d, **bf) + 0.5, torch.rand(d, **bf) + 0.5
    angles = torch.arange(4096, device="cuda")[:, None] * (1e-4 ** (torch.arange(0, d, 2, device="cuda") / d))
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    ref = fused.qk_norm_rope_ref(qkv.clone(), qw, kw, cos, sin, pos, heads, kv, d, 1e-6)
    got = fused.qk_norm_rope(qkv.clone(), qw, kw, cos, sin, pos, heads, kv, d, 1e-6)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    g = torch.randn(t, 2 * inter, **bf)
    torch.testing.assert_close(fused.silu_and_mul(g), fused.silu_and_mul_ref(g), atol=2e-2, rtol=2e-2)
    # folded norms: the same kernels applying the raw stream's 1/rms per row (PendingNorm)
    stream = torch.randn(t, h, **bf) * 4
    pending = fused.PendingNorm(stream, 1e-6)
    ref = fused.qk_norm_rope_ref(qkv.clone(), qw, kw, cos, sin, pos, heads, kv, d, 1e-6, pending)
    got = fused.qk_norm_rope(qkv.clone(), qw, kw, cos, sin, pos, heads, kv, d, 1e-6, pending)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(fused.silu_and_mul(g, pending), fused.silu_and_mul_ref(g, pending), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh"])
def test_gelu_epilogue_matches_the_exact_activation(act):
    """Linear.activated: bias + GELU in cuBLASLt's epilogue (the tanh form) against the model's
    activation in fp32 on the same BF16 weights: no further from it than the two-kernel path."""
    from pergola.layers.fused import ACTIVATIONS
    from pergola.layers.linear import Linear

    torch.manual_seed(0)
    dense = Linear(1024, 4096, bias=True)  # XLM-R large's intermediate projection
    torch.nn.init.normal_(dense.weight, std=0.03)
    torch.nn.init.normal_(dense.bias, std=0.5)
    dense = dense.to("cuda", torch.bfloat16)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():  # as the engine runs (parameters require grad; numpy() refuses such results)
        ref = ACTIVATIONS[act](torch.nn.functional.linear(x.float(), dense.weight.float(), dense.bias.float()))
        got = dense.activated(x, act).float()
        two_kernels = ACTIVATIONS[act](dense(x)).float()
    err, err_two = (got - ref).abs().max().item(), (two_kernels - ref).abs().max().item()
    assert err <= max(err_two, 2e-2), (err, err_two)
    assert cosine_rows(got.cpu().numpy(), ref.cpu().numpy()).min() >= 0.9999


@pytest.mark.parametrize("heads,kv,d", [(12, 12, 64), (16, 8, 128), (8, 1, 256)])  # ModernBERT, Qwen2, Gemma3
def test_rope_and_glu_kernels_match_references(heads, kv, d):
    """RoPE without a norm (in place on views of the qkv product), every GLU activation, LayerNorm."""
    from pergola.layers import fused

    torch.manual_seed(0)
    t, inter = 300, 1152
    bf = dict(device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(t, (heads + 2 * kv) * d, **bf)
    angles = torch.arange(8192, device="cuda")[:, None] * (1e-4 ** (torch.arange(0, d, 2, device="cuda") / d))
    cos, sin, pos = angles.cos(), angles.sin(), torch.randint(0, 8192, (t,), device="cuda")
    q, k, v = fused.split_qkv(qkv.clone(), heads, kv, d)
    want_q, want_k = fused.rope_ref(q, cos, sin, pos), fused.rope_ref(k, cos, sin, pos)
    v_before = v.clone()
    got_q, got_k = fused.rope_qk(q, k, cos, sin, pos)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_k, want_k, atol=3e-2, rtol=3e-2)
    assert torch.equal(v, v_before)  # v untouched
    g = torch.randn(t, 2 * inter, **bf) * 3
    for act in fused.ACTIVATIONS:
        torch.testing.assert_close(fused.act_and_mul(g, act), fused.act_and_mul_ref(g, act), atol=3e-2, rtol=3e-2)
    x, w, b, pre = (torch.randn(t, 768, **bf) * 3, torch.rand(768, **bf) + 0.5, torch.randn(768, **bf),
                    torch.randn(768, **bf))  # the post-norm layers' LayerNorm(x + the matmul's bias)
    torch.testing.assert_close(fused.layer_norm(x, w, b, 1e-12, pre), fused.layer_norm_ref(x, w, b, 1e-12, pre),
                               atol=3e-2, rtol=3e-2)


# --- Triton matmul tiles against cuBLAS -------------------------------------------------------
@pytest.mark.parametrize("m", [1, 77, 128, 300, 2048])
def test_triton_linear_matches_cublas(m):
    import torch.nn.functional as F
    from pergola.layers import fused, linear

    torch.manual_seed(m)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 1024, **bf)
    w = torch.randn(2048, 1024, **bf) * 1024**-0.5
    for tile in (linear.Tile(16, 32, 64), linear.Tile(64, 64, 128), linear.Tile(128, 128, 64, 8, 3),
                 linear.Tile(128, 128, 64, 8, 3, tma=True), linear.Tile(64, 64, 64, 4, 4, tma=True),
                 linear.Tile(16, 32, 64, split=8), linear.Tile(64, 64, 128, split=4),
                 linear.Tile(64, 64, 128, pdl=True), linear.Tile(16, 32, 64, split=8, pdl=True)):
        torch.testing.assert_close(linear.triton_linear(x, w, tile), F.linear(x, w), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(linear.triton_linear(x, w, tile, gated=True),
                                   fused.silu_and_mul_ref(F.linear(x, w)), atol=2e-2, rtol=2e-2)
        r = torch.randn(m, 2048, **bf)  # residual add in the epilogue: fp32 sum, one rounding
        out = r.clone()
        linear.triton_linear(x, w, tile, out=out)
        torch.testing.assert_close(out, (r.float() + F.linear(x, w).float()).bfloat16(), atol=3e-2, rtol=2e-2)
        # a folded norm (x the raw stream): pointer tiles sum x's squares in their K loop, TMA tiles
        # take the normalised x (linear.gated_linear)
        stream = x * 4
        torch.testing.assert_close(linear.gated_linear(stream, w, tile, fused.PendingNorm(stream, 1e-6)),
                                   fused.silu_and_mul_ref(F.linear(fused.rms_norm_ref(stream, None, 1e-6), w)),
                                   atol=2e-2, rtol=2e-2)
    r = torch.randn(m, 2048, **bf)  # cuBLAS's beta = 1 path, as the model calls it
    out = r.clone()
    assert linear.linear(x, w, out) is out
    torch.testing.assert_close(out, (r.float() + F.linear(x, w).float()).bfloat16(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("bm, bn, bk, split", [(16, 32, 64, 8), (64, 64, 128, 4), (128, 32, 64, 4)])
def test_split_k_is_deterministic_and_replays_in_a_graph(bm, bn, bk, split):
    """The last program of a tile adds the K slices in a fixed order: the same bits every call,
    eagerly and replayed from a CUDA graph, and the arrival counts are back at zero after each."""
    import torch.nn.functional as F
    from pergola.layers.linear import Tile, split_counters, triton_linear

    tile = Tile(bm, bn, bk, split=split)
    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, w = torch.randn(128, 3072, **bf), torch.randn(1024, 3072, **bf) * 3072**-0.5
    counters = split_counters(((128, tile),), 1024, x.device)
    first = triton_linear(x, w, tile, counters=counters)
    assert not counters.any()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_linear(x, w, tile, counters=counters)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = triton_linear(x, w, tile, counters=counters)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
        assert not counters.any()
    torch.testing.assert_close(first, F.linear(x, w), atol=2e-2, rtol=2e-2)


def test_dependent_launch_waits_for_each_input():
    """A chain of matmuls each reading the one before's output (residual adds, the gated tile's
    folded norm, split-K) gives the same bits launched with programmatic dependent launch as
    without, eagerly and replayed from a CUDA graph: each kernel reads its input only after
    gdc_wait, though it starts while the kernel before it runs."""
    from pergola.layers.fused import PendingNorm
    from pergola.layers.linear import Tile, gated_linear, linear, split_counters, triton_linear

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    layers, m = 6, 64
    wqkv = [torch.randn(4096, 1024, **bf) * 1024**-0.5 for _ in range(layers)]
    wo = [torch.randn(1024, 2048, **bf) * 2048**-0.5 for _ in range(layers)]
    wgu = [torch.randn(6144, 1024, **bf) * 1024**-0.5 for _ in range(layers)]
    wd = [torch.randn(1024, 3072, **bf) * 3072**-0.5 for _ in range(layers)]
    x0 = torch.randn(m, 1024, **bf)

    def chain(pdl: bool, x: torch.Tensor) -> torch.Tensor:
        plain, gated, split = (Tile(64, 64, 128, pdl=pdl), Tile(64, 32, 128, pdl=pdl),
                               Tile(64, 32, 128, split=2, pdl=pdl))
        counters = split_counters(((m, split),), 1024, x.device)
        for i in range(layers):
            qkv = triton_linear(x, wqkv[i], plain)  # [m, 4096]
            linear(qkv[:, :2048], wo[i], x, plain)  # x += o(q part), in place
            h = gated_linear(x, wgu[i], gated, PendingNorm(x, 1e-6))  # [m, 3072]
            linear(h, wd[i], x, split, counters)  # x += down(h)
        return x

    want = chain(False, x0.clone())
    assert want.isfinite().all()
    assert torch.equal(chain(True, x0.clone()), want)
    x = x0.clone()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True, x.clone())  # compile and warm up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        chain(True, x)
    for _ in range(3):
        x.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, want)


def test_triton_matmuls_change_nothing_in_the_model(qwen3_folders, tmp_path, monkeypatch):
    """Qwen3 with every matmul on a Triton tile equals the cuBLAS engine (same weights, texts)."""
    import json

    from pergola.layers import linear as linear_mod
    from pergola.layers.linear import Tile, dump_tiles, table_key

    folder = qwen3_folders["causal-last"]
    cfg = json.loads((folder / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    # qkv on the pointer kernel, o (which adds into the residual stream) on a split-K pointer tile,
    # down and gate_up + SiLU on the persistent TMA kernel
    tma = Tile(64, 64, 64, 4, 4, tma=True)
    table = {table_key("plain", (heads + 2 * kv) * d, h): [(1 << 20, Tile(64, 64, 64))],
             table_key("plain", h, heads * d): [(1 << 20, Tile(64, 64, 64, split=2))]}
    for key in (table_key("plain", h, inter), table_key("gated", inter, h)):
        table[key] = [(1 << 20, tma)]
    path = tmp_path / "tiles.json"
    dump_tiles(table, str(path))
    base = Engine(EngineConfig(model_dir=str(folder), device="cuda", matmul="cublas"))
    tiled = Engine(EngineConfig(model_dir=str(folder), device="cuda", matmul=str(path)))
    assert tiled.runner.matmul_tiles and not base.runner.matmul_tiles
    calls = {"plain": 0, "gated": 0, "tma": 0, "split": 0, "accumulate": 0}  # the base engine never runs Triton
    real, real_tma = linear_mod.triton_linear, linear_mod._launch_tma

    def spy(x, weight, tile, gated=False, out=None, **kw):
        calls["gated" if gated else "plain"] += 1
        calls["split"] += tile.split > 1
        calls["accumulate"] += out is not None  # o / down add into the residual stream
        return real(x, weight, tile, gated, out, **kw)

    def spy_tma(x, weight, y, tile, gated, accumulate):
        calls["tma"] += 1
        return real_tma(x, weight, y, tile, gated, accumulate)

    monkeypatch.setattr(linear_mod, "triton_linear", spy)
    monkeypatch.setattr(linear_mod, "_launch_tma", spy_tma)
    expected = embed(base, TEXTS)
    assert calls == {"plain": 0, "gated": 0, "tma": 0, "split": 0, "accumulate": 0}
    for _ in range(3):  # warm-up, capture, replay
        assert cosine_rows(embed(tiled, TEXTS), expected).min() >= 0.999
    layers = cfg["num_hidden_layers"]
    # traced twice: warm-up and capture
    assert calls == {"plain": 3 * 2 * layers, "gated": 2 * layers, "tma": 2 * 2 * layers, "split": 2 * layers,
                     "accumulate": 2 * 2 * layers}
