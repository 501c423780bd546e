"""bge-m3: the dense vector, sparse lexical weights and ColBERT vectors from one forward pass.

A tiny XLM-R folder in bge-m3's layout (pergola_testing.make_bge_m3_folder: seeded random weights,
FlagEmbedding's `sparse_linear.pt` / `colbert_linear.pt` beside the model) served through the real
server: each output must equal FlagEmbedding's formulas (BGEM3's inference code) computed here
with transformers on the same weights, a batch must equal its texts sent one by one, the ragged
offsets must cut the answer per text, and a model without the heads must refuse them by name.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MIN_COSINE, SAME, TEST_DEVICE, TEXTS, VALUE_ATOL, cosine_rows
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.pooling import finish
from pergola.outputs.token_outputs import row_width, skipped_token_ids, sparse_outputs, token_outputs
from pergola.text.tokenization import TextTokenizer
from test_classify import post  # (base URL, path, JSON body) -> (status, JSON answer)

XLMR_TEXTS = [*TEXTS, "repeated words repeated words repeated", "text with a literal <pad> token inside <pad> it"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pergola_testing import make_bge_m3_folder, make_xlm_roberta_folder

    root = tmp_path_factory.mktemp("bge-m3")
    return {"m3": make_bge_m3_folder(root / "m3", seed=11), "plain": make_xlm_roberta_folder(root / "plain", seed=12)}


def flag_embedding(folder: Path, texts: list[str], dtype: torch.dtype = torch.float32
                   ) -> tuple[np.ndarray, list[dict[int, float]], list[np.ndarray]]:
    """FlagEmbedding's BGEM3 inference on `texts`, one at a time (no padding): dense = the CLS
    state normalised; lexical weights = {token id: max ReLU(sparse_linear(h))} without cls / eos /
    pad / unk and zero weights; ColBERT = normalize(colbert_linear(h[1:])). `dtype`: the model's
    and the heads' (BF16: what transformers itself gets in BF16, the yardstick for pergola's)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=dtype).eval()
    hidden = model.config.hidden_size
    sparse, colbert = torch.nn.Linear(hidden, 1, dtype=dtype), torch.nn.Linear(hidden, hidden, dtype=dtype)
    sparse.load_state_dict(torch.load(folder / "sparse_linear.pt", weights_only=True))
    colbert.load_state_dict(torch.load(folder / "colbert_linear.pt", weights_only=True))
    unused = {tok.cls_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    dense, lexical, multi = [], [], []
    with torch.no_grad():
        for text in texts:
            feats = tok(text, truncation=True, max_length=512, return_tensors="pt")
            h = model(**feats).last_hidden_state[0]  # [L, H]
            dense.append(torch.nn.functional.normalize(h[0].float(), dim=-1).numpy())
            weights = torch.relu(sparse(h)).squeeze(-1).float()
            lex: dict[int, float] = {}
            for w, idx in zip(weights.tolist(), feats["input_ids"][0].tolist()):
                if idx not in unused and w > 0 and w > lex.get(idx, 0.0):
                    lex[idx] = w
            lexical.append(lex)
            multi.append(torch.nn.functional.normalize(colbert(h[1:]).float(), dim=-1).numpy())
    return np.stack(dense), lexical, multi


def as_dicts(indices: np.ndarray, values: np.ndarray, offsets: np.ndarray) -> list[dict[int, float]]:
    return [dict(zip(indices[a:b].tolist(), values[a:b].tolist())) for a, b in zip(offsets[:-1], offsets[1:])]


def assert_lexical_equal(ours: list[dict[int, float]], reference: list[dict[int, float]], atol: float = 1e-4) -> None:
    assert len(ours) == len(reference)
    for got, want in zip(ours, reference):
        assert sorted(got) == sorted(want)
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), atol=atol, rtol=0)


def assert_lexical_matches(ours: list[dict[int, float]], reference: list[dict[int, float]]) -> None:
    """Against FlagEmbedding's FP32 weights: the same tokens and weights within 1e-4 from an FP32
    server; from a BF16 one (a GPU test server), a lexical cosine >= 0.99, as
    test_gpu_gives_flag_embeddings_outputs (a weight near zero may round to zero and drop its token)."""
    if TEST_DEVICE == "cpu":
        assert_lexical_equal(ours, reference)
    else:
        assert min(lexical_cosine(g, w) for g, w in zip(ours, reference)) >= 0.99


def assert_colbert_equal(vectors: np.ndarray, offsets: np.ndarray, reference: list[np.ndarray],
                         atol: float = 1e-4) -> None:
    assert offsets.tolist() == np.cumsum([0] + [r.shape[0] for r in reference]).tolist()
    for a, b, want in zip(offsets[:-1], offsets[1:], reference):
        np.testing.assert_allclose(vectors[a:b], want, atol=atol, rtol=0)
        assert cosine_rows(vectors[a:b], want).min() >= 0.9999


# --- units ------------------------------------------------------------------------------------

def test_folder_with_the_heads_offers_their_outputs(folders):
    assert load_model_spec(folders["m3"]).outputs == ("dense", "sparse", "colbert")
    assert load_model_spec(folders["plain"]).outputs == ("dense",)
    assert skipped_token_ids(load_model_spec(folders["m3"])).tolist() == [0, 1, 2, 3]  # <s> <pad> </s> <unk>


def test_sparse_keeps_the_largest_weight_of_each_token_and_drops_specials():
    ids = np.array([0, 7, 9, 7, 2, 0, 5, 5, 2], dtype=np.int64)
    weights = np.array([0.9, 0.2, 0.0, 0.5, 0.8, 0.7, 0.3, 0.1, 0.6], dtype=np.float32)
    indices, values, offsets = sparse_outputs(ids, np.array([5, 0, 4]), weights, np.array([0, 2]))
    assert offsets.tolist() == [0, 1, 1, 2]  # text 1 is empty; 9 has weight 0
    assert indices.tolist() == [7, 5] and values.tolist() == pytest.approx([0.5, 0.3])


def engine_outputs(engine: Engine, texts: list[str]) -> tuple[np.ndarray, list[dict[int, float]], np.ndarray,
                                                               np.ndarray]:
    """In process, one request: (dense [n, H] normalised, lexical weights, ColBERT rows, their offsets)."""
    enc = TextTokenizer(engine.spec).encode(texts)
    req = EncodeRequest(enc.input_ids, enc.lengths,
                        token_rows=np.empty((enc.input_ids.size, engine.runner.token_width), np.float32))
    pooled = finish(engine.encode([req])[0], 0, engine.spec.normalize)
    out = token_outputs(engine.spec, ("sparse", "colbert"), enc.input_ids, enc.lengths, req.token_rows,
                        skipped_token_ids(engine.spec))
    lexical = as_dicts(out["SPARSE_INDICES"], out["SPARSE_VALUES"], out["SPARSE_OFFSETS"])
    return pooled, lexical, out["TOKEN_EMBEDDINGS"], out["TOKEN_OFFSETS"]


def test_engine_outputs_equal_flag_embedding(folders):
    """In process: one forward gives all three, batched as one request."""
    engine = Engine(EngineConfig(model_dir=str(folders["m3"]), dtype="float32", device="cpu"))
    pooled, lexical, vectors, offsets = engine_outputs(engine, XLMR_TEXTS)
    dense, reference, multi = flag_embedding(folders["m3"], XLMR_TEXTS)
    assert cosine_rows(pooled, dense).min() >= 0.9999
    assert_lexical_equal(lexical, reference)
    assert_colbert_equal(vectors, offsets, multi)


def lexical_cosine(got: dict[int, float], want: dict[int, float]) -> float:
    """Cosine of two lexical weight maps as vocabulary-sized vectors (a missing id weighs 0; two
    empty maps agree)."""
    keys = sorted(set(got) | set(want))
    if not keys:
        return 1.0
    a, b = np.array([got.get(k, 0.0) for k in keys]), np.array([want.get(k, 0.0) for k in keys])
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def lexical_max_error(got: dict[int, float], want: dict[int, float]) -> float:
    """The largest difference of two lexical weight maps over every token id in either (a missing
    id weighs 0)."""
    return max((abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in set(got) | set(want)), default=0.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_sparse_request_gets_only_the_sparse_column(folders, device):
    """A request for sparse alone takes one column of the per-token rows; in a step beside one
    that asked for colbert too, both get what they asked for (on a GPU: BF16, static buffers)."""
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = Engine(EngineConfig(model_dir=str(folders["m3"]), dtype=dtype, device=device))
    width = engine.runner.token_width
    assert (row_width(("dense",), width), row_width(("sparse",), width), row_width(("colbert",), width)) == (0, 1, 65)
    enc = TextTokenizer(engine.spec).encode(XLMR_TEXTS[:4])
    sparse_only, both = (EncodeRequest(enc.input_ids, enc.lengths, token_rows=np.empty((enc.input_ids.size, w),
                                                                                       np.float32)) for w in (1, width))
    engine.encode([sparse_only, both])
    tol = 1e-6 if device == "cpu" else 1e-2  # the same text at other rows of the step's matmuls
    np.testing.assert_allclose(sparse_only.token_rows[:, 0], both.token_rows[:, 0], atol=tol, rtol=tol)
    np.testing.assert_allclose(np.linalg.norm(both.token_rows[:, 1:], axis=1), 1.0, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["tiny", "bge-m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_gives_flag_embeddings_outputs(tmp_path, shape, dtype):
    """On the GPU, batched and one text at a time, three times (BF16: eager warm-up, CUDA-graph
    capture and replay; FP32: the padded SDPA path without lanes) against FP32 FlagEmbedding:
    FP32 within 1e-3; BF16 dense and ColBERT cosine >= 0.999, lexical weights no further from
    FP32's than twice what the same formulas in BF16 in transformers get (largest difference over
    every token id). In the published shape a seeded random 24-layer stack leaves most weights
    near zero, where BF16's rounding turns them on or off: transformers' own BF16 differs from its
    FP32 by up to 0.09 on weights of up to 0.32, and a text's weights as vectors can have cosine 0
    (perf/RESULTS.md, 2026-12-05)."""
    from pergola_testing import make_bge_m3_folder

    folder = make_bge_m3_folder(tmp_path / shape, shape=shape, seed=13)
    dense, reference, multi = flag_embedding(folder, XLMR_TEXTS)
    if dtype == "bfloat16":
        theirs = flag_embedding(folder, XLMR_TEXTS, torch.bfloat16)[1]
        lexical_bound = 2 * max(lexical_max_error(got, want) for got, want in zip(theirs, reference)) + 1e-3
    engine = Engine(EngineConfig(model_dir=str(folder), dtype=dtype, device="cuda"))
    for _ in range(3):
        for texts, first in [(XLMR_TEXTS, 0)] + [([t], i) for i, t in enumerate(XLMR_TEXTS)]:
            pooled, lexical, vectors, offsets = engine_outputs(engine, texts)
            wanted = reference[first:first + len(texts)]
            if dtype == "float32":
                np.testing.assert_allclose(pooled, dense[first:first + len(texts)], atol=1e-3, rtol=0)
                assert_lexical_equal(lexical, wanted, atol=1e-3)
                assert_colbert_equal(vectors, offsets, multi[first:first + len(texts)], atol=1e-3)
                continue
            assert cosine_rows(pooled, dense[first:first + len(texts)]).min() >= 0.999
            assert max(lexical_max_error(got, want) for got, want in zip(lexical, wanted)) <= lexical_bound
            for i in range(len(texts)):
                assert cosine_rows(vectors[offsets[i]:offsets[i + 1]], multi[first + i]).min() >= 0.999
    if dtype == "bfloat16":
        assert engine.stats["steps_replay"] > 0


# --- through the server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, folders):
    from conftest import start_serve

    device = ["--device", "gpu"] if TEST_DEVICE == "gpu" else []
    # --gateway-tokenize-chars 1024: the TEI route test sends 4 short texts (tokenized in the
    # gateway) and 4 of XLM-R's test texts, 2,200 characters and more (through the ensemble)
    proc = start_serve(tmp_path_factory.mktemp("serve-m3"), f"m3={folders['m3']}", "--model",
                       f"plain={folders['plain']}", "--gateway-tokenize-chars", "1024", *device)
    yield proc
    proc.stop()


def infer(served, texts: list[str], outputs: list[str] | None, model: str = "m3") -> dict[str, np.ndarray]:
    """The embed ensemble's answer by output name (a model without the heads has EMBEDDING alone)."""
    import tritonclient.grpc as grpcclient

    names = ["EMBEDDING"]
    if model == "m3":
        names += ["SPARSE_INDICES", "SPARSE_VALUES", "SPARSE_OFFSETS", "TOKEN_EMBEDDINGS", "TOKEN_OFFSETS"]
    with grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}") as client:
        inputs = [grpcclient.InferInput("TEXT", [len(texts)], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
        if outputs is not None:
            inputs.append(grpcclient.InferInput("OUTPUTS", [len(outputs)], "BYTES"))
            inputs[1].set_data_from_numpy(np.array([o.encode() for o in outputs], dtype=object))
        result = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in names])
        return {n: result.as_numpy(n) for n in names}


def test_served_outputs_equal_flag_embedding_in_one_request(served, folders):
    out = infer(served, XLMR_TEXTS, ["dense", "sparse", "colbert"])
    dense, lexical, multi = flag_embedding(folders["m3"], XLMR_TEXTS)
    np.testing.assert_allclose(out["EMBEDDING"], dense, atol=VALUE_ATOL, rtol=0)
    assert cosine_rows(out["EMBEDDING"], dense).min() >= MIN_COSINE
    assert_lexical_matches(as_dicts(out["SPARSE_INDICES"], out["SPARSE_VALUES"], out["SPARSE_OFFSETS"]), lexical)
    if TEST_DEVICE == "cpu":
        assert_colbert_equal(out["TOKEN_EMBEDDINGS"], out["TOKEN_OFFSETS"], multi)
    else:  # BF16: as test_gpu_gives_flag_embeddings_outputs
        offsets = out["TOKEN_OFFSETS"]
        for a, b, want in zip(offsets[:-1], offsets[1:], multi):
            assert cosine_rows(out["TOKEN_EMBEDDINGS"][a:b], want).min() >= 0.999


def test_client_embed_outputs_over_http(served, folders):
    """pergola_client's embed_outputs (Triton's HTTP/JSON protocol): the same three outputs."""
    from pergola_client import PergolaClient

    texts = XLMR_TEXTS[:3]
    with PergolaClient(f"127.0.0.1:{served.http}", protocol="http", model="m3") as client:
        out = client.embed_outputs(texts)
    dense, lexical, multi = flag_embedding(folders["m3"], texts)
    assert cosine_rows(out.dense, dense).min() >= MIN_COSINE
    assert [sorted(d) for d in out.sparse] == [sorted(d) for d in lexical] or TEST_DEVICE != "cpu"
    for got, want in zip(out.colbert, multi):
        assert got.shape == want.shape and cosine_rows(got, want).min() >= 0.999


# Lexical weights are ReLU(w . h + b) of the unnormalised hidden state (values up to ~2): on a GPU
# a BF16 step of h moves one by more than SAME allows (0.1206 vs 0.1260 on the H100,
# perf/results/2026-12-05-e2aaa64/pytest_recheck.log), so they get the reference bound instead.
SPARSE_SAME = SAME if TEST_DEVICE == "cpu" else {"atol": VALUE_ATOL, "rtol": 0.0}


def test_served_batch_equals_single_texts(served):
    batch = infer(served, XLMR_TEXTS, ["sparse", "colbert", "dense"])
    for i, text in enumerate(XLMR_TEXTS):
        one = infer(served, [text], ["colbert", "sparse"])
        assert one["EMBEDDING"].shape == (1, 0)  # dense not asked for
        s, t = batch["SPARSE_OFFSETS"], batch["TOKEN_OFFSETS"]
        np.testing.assert_array_equal(one["SPARSE_INDICES"], batch["SPARSE_INDICES"][s[i]:s[i + 1]])
        np.testing.assert_allclose(one["SPARSE_VALUES"], batch["SPARSE_VALUES"][s[i]:s[i + 1]], **SPARSE_SAME)
        np.testing.assert_allclose(one["TOKEN_EMBEDDINGS"], batch["TOKEN_EMBEDDINGS"][t[i]:t[i + 1]], **SAME)


def test_served_defaults_to_dense_only(served):
    out = infer(served, XLMR_TEXTS[:3], None)
    assert out["EMBEDDING"].shape[0] == 3 and out["SPARSE_OFFSETS"].size == 0 and out["TOKEN_OFFSETS"].size == 0
    assert out["TOKEN_EMBEDDINGS"].shape[0] == 0


def test_ragged_offsets_cut_per_text(served, folders):
    from transformers import AutoTokenizer

    texts = ["a", "MiXeD", "two words and more"]
    out = infer(served, texts, ["sparse", "colbert"])
    assert out["SPARSE_OFFSETS"].shape == (4,) and out["TOKEN_OFFSETS"].shape == (4,)
    assert out["SPARSE_OFFSETS"][0] == 0 and out["SPARSE_OFFSETS"][-1] == out["SPARSE_INDICES"].size
    assert out["SPARSE_INDICES"].dtype == np.int64 and out["SPARSE_VALUES"].dtype == np.float32
    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(str(folders["m3"]))(texts)["input_ids"]]
    assert np.diff(out["TOKEN_OFFSETS"]).tolist() == [n - 1 for n in lengths]  # every token but CLS
    assert out["TOKEN_EMBEDDINGS"].shape == (sum(lengths) - 3, 64)
    assert (out["SPARSE_VALUES"] > 0).all()


@pytest.mark.parametrize("outputs, message", [
    (["sparse"], "OUTPUTS 'sparse' not offered: this model gives dense"),
    (["dense", "colbert"], "OUTPUTS 'colbert' not offered"),
])
def test_a_model_without_the_heads_refuses_them(served, outputs, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=message) as e:
        infer(served, ["text"], outputs, model="plain")
    assert "INVALID_ARG" in str(e.value.status()) or "sparse_linear.pt" in str(e.value)


def test_only_a_model_with_the_heads_declares_their_outputs(served):
    """Each output an ensemble maps costs every request a tensor: a plain embedder's has none of them."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}") as client:
        outputs = {name: {o.name for o in client.get_model_config(name).config.output} for name in ("m3", "plain")}
    assert {"SPARSE_INDICES", "TOKEN_EMBEDDINGS"} <= outputs["m3"]
    assert not {"SPARSE_INDICES", "SPARSE_VALUES", "SPARSE_OFFSETS", "TOKEN_EMBEDDINGS", "TOKEN_OFFSETS"} & outputs["plain"]
    assert infer(served, ["text"], ["dense"], model="plain")["EMBEDDING"].shape == (1, 64)


def test_unknown_output_is_refused_by_name(served):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="'lexical' not offered: this model gives dense, sparse, "
                                                       "colbert"):
        infer(served, ["text"], ["lexical"])


# --- TEI's routes on the gateway -----------------------------------------------------------------

@pytest.mark.parametrize("tokenized", ["in the gateway", "by the ensemble"])
def test_tei_embed_sparse_and_embed_all(served, folders, tokenized):
    from test_gateway import tokenized_inputs

    base = served.wait_gateway()
    # (under and over the served fixture's --gateway-tokenize-chars, 1,024: XLMR_TEXTS[1] alone is 2,200 characters)
    texts = [t for t in XLMR_TEXTS if len(t) < 100][:4] if tokenized == "in the gateway" else XLMR_TEXTS[:4]
    for _ in range(100):  # the gateway loads m3's tokenizer on its first short request
        before = tokenized_inputs(base).get("gateway", 0.0)
        assert post(base, "/embed", {"inputs": "warm up", "model": "m3"})[0] == 200
        if tokenized_inputs(base).get("gateway", 0.0) > before:
            break
        time.sleep(0.1)
    _, lexical, multi = flag_embedding(folders["m3"], texts)
    before = tokenized_inputs(base)
    status, sparse = post(base, "/embed_sparse", {"inputs": texts, "model": "m3"})
    assert status == 200
    assert_lexical_matches([{e["index"]: e["value"] for e in entries} for entries in sparse], lexical)
    where = "gateway" if tokenized == "in the gateway" else "triton"
    assert tokenized_inputs(base)[where] - before.get(where, 0.0) == len(texts)
    status, tokens = post(base, "/embed_all", {"inputs": texts[0], "model": "m3"})
    assert status == 200 and len(tokens) == 1
    np.testing.assert_allclose(np.array(tokens[0]), multi[0], atol=VALUE_ATOL, rtol=0)
    status, error = post(base, "/embed_sparse", {"inputs": "text", "model": "plain"})
    assert status in (400, 422) and "not offered" in error["error"]
