"""The architectures the benchmarks time against vLLM besides Qwen3 and MiniLM (perf/common.py's
ARCH_MODELS: bge-m3, gte-modernbert), on the CPU: their tiny twins build and load as the kind of
model they stand for, the published shapes' declarations fit their tables, and both benchmarks'
command lines take them, with Qwen3's lengths on the GPU and the twins in a dry run."""

from __future__ import annotations

import bench_server
import bench_vllm
import pergola_testing as testing
import pytest
from common import ARCH_MODELS, LAT_LENGTHS, TPUT_LENGTHS, arch_model, dry_twin, model_folder
from pergola.config.hf_folder import load_model_spec, max_positions

KINDS = {"bge-m3": ("bert", ("sparse", "colbert")), "gte-modernbert": ("modernbert", ())}
SHAPE_TABLES = {"make_bge_m3_folder": (testing.XLMR_SHAPES, "xlm-roberta"),
                "make_modernbert_folder": (testing.MODERNBERT_SHAPES, "modernbert")}


@pytest.mark.parametrize("name", sorted(ARCH_MODELS))
def test_tiny_twin_builds_as_its_model(tmp_path, name):
    """The twin is what a dry run serves: the same layout (CLS + normalize, bge-m3's heads) in BF16."""
    folder = model_folder(dry_twin(name), tmp_path)
    spec = load_model_spec(folder)
    assert (spec.architecture, spec.token_heads) == KINDS[name]
    assert (spec.pooling, spec.normalize) == ("cls", True)
    assert spec.hf_config["dtype"] == "bfloat16"
    assert max(LAT_LENGTHS[dry_twin(name)] + TPUT_LENGTHS[dry_twin(name)]) <= spec.max_seq_length


@pytest.mark.parametrize("name", sorted(ARCH_MODELS))
def test_published_shape_holds_the_longest_input(name):
    """Without building the 0.15-0.57 B-parameter folders: the declared shape exists and its position
    table covers the declared limit, which covers the longest benchmark input."""
    decl, tiny = arch_model(name)
    table, model_type = SHAPE_TABLES[decl.maker]
    shape = table[decl.shape] | {"model_type": model_type, "pad_token_id": 1}  # XLM-R's pad, as the maker's
    assert not tiny and callable(getattr(testing, decl.maker))
    assert max(LAT_LENGTHS[name] + TPUT_LENGTHS[name]) <= decl.max_seq_length <= max_positions(shape)


def test_xlm_roberta_folder_takes_a_limit(tmp_path):
    """bge-m3 publishes 8,192 tokens; the maker's default stays 512 (position table permitting)."""
    assert load_model_spec(testing.make_xlm_roberta_folder(tmp_path / "a", max_seq_length=256)).max_seq_length == 256
    assert load_model_spec(testing.make_xlm_roberta_folder(tmp_path / "b")).max_seq_length == 512


@pytest.mark.parametrize("name", sorted(ARCH_MODELS))
def test_command_lines_take_the_models(name):
    assert bench_server.arg_parser().parse_args(["--model", name]).model == name
    assert bench_server.arg_parser().parse_args(["--model", dry_twin(name), "--device", "cpu"]).model == dry_twin(name)
    args = bench_vllm.arg_parser().parse_args(["--models", name, "--suites", "inproc", "server"])
    assert args.models == [name]


@pytest.mark.parametrize("name", sorted(ARCH_MODELS))
def test_vllm_plans(name):
    """Qwen3's lengths and limit on the GPU; the twin at one short length in a dry run; suite keys by name."""
    full, dry = bench_vllm.Plan().for_model(name, False), bench_vllm.Plan.dry().for_model(name, True)
    assert (full.embed_model, full.lat_lengths, full.tput_lengths) == (name, (128, 512, 4096), (512, 1024, 4096))
    assert (full.check_length, full.conc_length, full.max_model_len) == (512, 512, 8192)
    assert (dry.embed_model, dry.lat_lengths, dry.tput_lengths, dry.max_model_len) == (dry_twin(name), (128,), (128,), 512)
    assert bench_vllm.split_suite(bench_vllm.keyed("server", name)) == ("server", name)


def test_vllm_client_sends_token_ids_where_asked():
    """Token ids go to /v1/embeddings (`embedding` back) by default, to /pooling (task "embed", the
    `data` field back) with --ids-api pooling; texts always to /v1/embeddings."""
    import base64
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, body))
            field = "data" if self.path == "/pooling" else "embedding"
            vec = base64.b64encode(np.arange(3, dtype="<f4").tobytes()).decode()
            out = json.dumps({"data": [{"index": i, field: vec} for i in range(len(body["input"]))]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ids = [np.array([5, 6, 7]), np.array([8])]
        for api, path in (("pooling", "/pooling"), ("embeddings", "/v1/embeddings")):
            client = bench_vllm.HttpClient(*server.server_address, api)
            assert client.embed_ids(ids).tolist() == [[0.0, 1.0, 2.0]] * 2
            assert seen[-1][0] == path and seen[-1][1]["input"] == [[5, 6, 7], [8]]
            assert seen[-1][1].get("task") == ("embed" if api == "pooling" else None)
            client.embed(["a text"])
            assert seen[-1][0] == "/v1/embeddings"
    finally:
        server.shutdown()
    assert bench_vllm.arg_parser().parse_args([]).ids_api == "embeddings"


def test_throughput_interleaved_takes_turns_and_times_each_callable_alone(monkeypatch):
    """bench_engine's A/B throughput: one call of each engine in turn, so that a drift of the GPU's
    clocks moves both columns, and each column's time is its own calls' only."""
    import time

    import common
    from common import time_throughput_interleaved

    monkeypatch.setattr(common, "DEVICE", "cpu")
    order: list[str] = []

    def call(label: str, seconds: float):
        def run(batch: list) -> None:
            order.append(label)
            time.sleep(seconds)
        return run

    batch = [[1, 2, 3]] * 4
    timed = time_throughput_interleaved({"a": call("a", 0.002), "b": call("b", 0.008)}, batch,
                                        min_seconds=0.05, warmup=1)
    assert order[:2] == ["a", "b"]  # the warm-ups, one each
    timed_order = order[2:]
    assert timed_order == ["a", "b"] * (len(timed_order) // 2)
    assert timed["a"]["reps"] == timed["b"]["reps"] >= 3
    assert timed["b"]["embeddings_per_s"] <= len(batch) / 0.008  # b's own 8 ms calls, not a's
    assert timed["a"]["embeddings_per_s"] > 2 * timed["b"]["embeddings_per_s"]
    assert timed["a"]["tokens_per_s"] == pytest.approx(timed["a"]["embeddings_per_s"] * 3)


def test_engine_split_parts_fit_within_each_call(minilm_folder):
    """bench_engine's in-process split of a batch-1 call (compared with bench_adapter's inside Triton):
    both parts measured, and together no longer than the calls themselves."""
    import time

    import common
    import numpy as np
    from pergola.config.engine import EngineConfig
    from pergola.engine import Engine

    engine = Engine(EngineConfig(model_dir=str(minilm_folder)))
    inputs = [[np.arange(100, 100 + n, dtype=np.int64)] for n in (16, 40)]
    t0 = time.perf_counter()
    split = common.engine_split(engine, inputs, 6)
    wall_us = (time.perf_counter() - t0) * 1e6
    assert set(split) == set(common.ENGINE_PHASES)
    assert split["pack + launch"] > 0 and min(split.values()) >= 0
    assert split["pack + launch"] + split["device + copy back"] <= wall_us / 6 * 2  # medians of 6 calls
    assert split["gather"] <= split["pack + launch"] and split["replay / kernels"] <= split["pack + launch"]


def test_encoder_start_lines_keep_the_kernel_choices(tmp_path):
    """bench_server keeps the encoder's start-up lines (kernels by step size, the probe's timings)
    from tritonserver's log, and nothing else; a missing log gives none."""
    from common import encoder_start_lines

    log = tmp_path / "tritonserver.log"
    chosen = ('I1207 21:47:03.452676 26616 model.py:73] "bench_encoder: device cuda:0, attention '
              "{'graph_upto_512': 'torch_flash', 'eager': 'flashinfer_fa3'}, CUDA graphs on\"")
    probe = "I1207 21:47:03.452690 26616 model.py:78] \"bench_encoder: attention probe, µs per layer call: {'x': 1}\""
    log.write_text("\n".join(["I1207 21:47:01.0 1 server.cc:1] started", chosen, probe, "I1207 done"]) + "\n")
    assert encoder_start_lines(log) == [chosen, probe]
    assert encoder_start_lines(log, max_chars=20) == [chosen[:20], probe[:20]]
    assert encoder_start_lines(tmp_path / "absent.log") == []
