"""Sequence classification (`classify`): engine, Triton ensemble and gateway routes against
transformers' AutoModelForSequenceClassification (FP32, CPU), on seeded folders in the BERT
(softmax, pairs with token types) and XLM-R (multi-label: sigmoid) shapes, ModernBERT (mean
classifier pooling) through the engine. One server for the module."""

from __future__ import annotations

import functools
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VALUE_ATOL
from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.engine import EncodeRequest, Engine
from pergola.outputs.heads import activate, activation
from pergola.text.classify import ClassifyTokenizer
from pergola_testing import CLASSIFIER_LABELS, make_classifier_folder

TEXTS = ["I loved every minute of it.", "The service was slow and the food was cold.", "北京是中国的首都。",
         "🚀 rockets and emoji", "words " * 700]  # the last is over the limit: cut at its end
PAIRS = [("A man is eating.", "Someone eats food."), ("A cat sleeps.", "The stock market fell " * 200)]
TOPICS = ("news", 'say "hi"\\', "sports")  # quotes and a backslash travel through config.pbtxt
LABELS = {"bert": list(CLASSIFIER_LABELS), "xlmr": list(TOPICS)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {"bert": make_classifier_folder(root / "bert", "bert", seed=3),
            "xlmr": make_classifier_folder(root / "xlmr", "xlm-roberta", seed=4, labels=TOPICS,
                                           problem_type="multi_label_classification"),
            "modernbert": make_classifier_folder(root / "modernbert", "modernbert", seed=5)}


@functools.cache
def transformers_classifier(folder: Path):
    """(tokenizer, model) of a folder, loaded once for the module's many references."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(folder)), model


def reference_logits(folder: Path, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
    """transformers' logits, one input at a time (no padding), truncated as its tokenizer does."""
    tok, model = transformers_classifier(folder)
    rows = []
    with torch.no_grad():
        for i, text in enumerate(texts):
            feats = tok(text, pairs[i] if pairs else None, truncation=True, return_tensors="pt",
                        max_length=load_model_spec(folder).max_seq_length)
            rows.append(model(**feats).logits[0].numpy())
    return np.stack(rows)


def reference_probs(folder: Path, logits: np.ndarray) -> np.ndarray:
    """What transformers' pipeline applies: sigmoid for multi-label models, softmax otherwise."""
    config = json.loads((folder / "config.json").read_text())
    t = torch.from_numpy(logits)
    multi = config.get("problem_type") == "multi_label_classification"
    return (torch.sigmoid(t) if multi else torch.softmax(t, dim=-1)).numpy()


def engine_logits(engine: Engine, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
    enc = ClassifyTokenizer(engine.spec, engine.cfg.text_limits()).encode(texts, pairs)
    request = EncodeRequest(enc.input_ids, enc.lengths, token_types=enc.token_type_ids)
    engine.validate(request)
    return engine.encode([request])[0]


def test_folder_says_classify(folders):
    for kind, folder in folders.items():
        spec = load_model_spec(folder)
        assert (spec.task, spec.pooling, spec.num_labels) == ("classify", "mean" if kind == "modernbert" else "cls", 3)
    assert activation(load_model_spec(folders["bert"])) == "softmax"
    assert activation(load_model_spec(folders["xlmr"])) == "sigmoid"


@pytest.mark.parametrize("kind", ["bert", "xlmr", "modernbert"])
def test_engine_matches_transformers(folders, kind):
    folder = folders[kind]
    engine = Engine(EngineConfig(model_dir=str(folder)))
    logits = engine_logits(engine, TEXTS)
    expected = reference_logits(folder, TEXTS)
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
    how = activation(engine.spec)
    np.testing.assert_allclose(activate(logits, how), reference_probs(folder, expected), atol=1e-5, rtol=0)
    singles = np.concatenate([engine_logits(engine, [t]) for t in TEXTS])
    np.testing.assert_allclose(logits, singles, atol=1e-5, rtol=0)
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]  # longest_first cuts the long second text
    np.testing.assert_allclose(engine_logits(engine, firsts, seconds), reference_logits(folder, firsts, seconds),
                               atol=1e-4, rtol=0)


def test_too_long_with_truncation_off_is_refused(folders):
    from pergola.text.errors import RequestError

    tok = ClassifyTokenizer(load_model_spec(folders["bert"]), EngineConfig(model_dir=str(folders["bert"])).text_limits())
    assert tok.encode(TEXTS).truncated.tolist() == [False] * 4 + [True]
    with pytest.raises(RequestError, match=r"TEXT\[4\] has more than 512 tokens"):
        tok.encode(TEXTS, truncate="NONE")
    with pytest.raises(RequestError, match="TEXT_PAIR has 1 strings for 2"):
        tok.encode(TEXTS[:2], ["x"])


@pytest.fixture(scope="module")
def served(folders, tmp_path_factory: pytest.TempPathFactory):
    from conftest import start_serve

    process = start_serve(tmp_path_factory.mktemp("classify-serve"), f"sentiment={folders['bert']}",
                          "--model", f"topics={folders['xlmr']}")
    try:
        yield process, process.wait_gateway()
    finally:
        process.stop()


@pytest.fixture(scope="module", params=["tokenized in the gateway", "through the ensemble"])
def gateway(served, request, tmp_path_factory: pytest.TempPathFactory):
    """The served gateway, its classifiers' tokenizers loaded (short requests are tokenized there),
    or a second gateway that sends every text through the classify ensemble."""
    from test_gateway import start_gateway, tokenized_inputs, tokenizer_loaded

    process, base = served
    if request.param == "tokenized in the gateway":
        for model in ("sentiment", "topics"):
            tokenizer_loaded(base, model, ("/classify", {"input": "warm up"}))
        yield base, "gateway", tokenized_inputs
        return
    gw = start_gateway(tmp_path_factory.mktemp("classify-gateway"), f"127.0.0.1:{process.grpc}",
                       "--models", "sentiment,topics", "--gateway-tokenize-chars", "0", http=process.http)
    try:
        yield gw.url, "triton", tokenized_inputs
    finally:
        gw.stop()


def post(base: str, path: str, body: object) -> tuple[int, object]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("name,kind", [("sentiment", "bert"), ("topics", "xlmr")])
def test_server_matches_transformers(served, folders, name, kind):
    import tritonclient.grpc as grpcclient

    process, _ = served
    logits = reference_logits(folders[kind], TEXTS)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{process.grpc}")

    def infer(model: str, raw: bool) -> tuple[np.ndarray, list[str]]:
        text = grpcclient.InferInput("TEXT", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=object))
        inputs = [text]
        if raw:
            inputs.append(grpcclient.InferInput("RAW_SCORES", [1], "BOOL"))
            inputs[-1].set_data_from_numpy(np.array([True]))
        result = client.infer(model, inputs)
        return result.as_numpy("PROBS"), [s.decode() for s in result.as_numpy("LABELS")]

    probs, labels = infer(name, raw=False)
    assert labels == LABELS[kind] and probs.shape == (len(TEXTS), 3)
    np.testing.assert_allclose(probs, reference_probs(folders[kind], logits), atol=VALUE_ATOL, rtol=0)
    np.testing.assert_allclose(infer(name, raw=True)[0], logits, atol=VALUE_ATOL, rtol=0)
    if name == "sentiment":  # the first classifier is also `classify`; pairs through the client
        from pergola_client import PergolaClient

        firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
        with PergolaClient(f"127.0.0.1:{process.grpc}") as pergola:
            result = pergola.classify(firsts, seconds, raw_scores=True)
        assert result.labels == list(CLASSIFIER_LABELS)
        np.testing.assert_allclose(result.probs, reference_logits(folders[kind], firsts, seconds), atol=VALUE_ATOL,
                                   rtol=0)
        np.testing.assert_allclose(infer("classify", raw=False)[0], probs, atol=0, rtol=0)


def test_tei_predict(gateway, folders):
    base, where, tokenized_inputs = gateway
    before = tokenized_inputs(base).get(where, 0.0)
    folder = folders["bert"]
    logits = reference_logits(folder, TEXTS)
    probs = reference_probs(folder, logits)
    status, single = post(base, "/predict", {"model": "sentiment", "inputs": TEXTS[0]})
    assert status == 200, single
    assert [p["label"] for p in single] == [CLASSIFIER_LABELS[j] for j in np.argsort(-probs[0], kind="stable")]
    np.testing.assert_allclose([p["score"] for p in single], np.sort(probs[0])[::-1], atol=VALUE_ATOL, rtol=0)
    # a batch mixing single texts and a pair, answered in input order
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    pair_probs = reference_probs(folder, reference_logits(folder, firsts, seconds))
    status, batch = post(base, "/predict", {"model": "sentiment", "inputs": [[TEXTS[1]], list(PAIRS[1]), [TEXTS[2]]],
                                            "raw_scores": True})
    assert status == 200, batch
    for got, want in zip(batch, [logits[1], reference_logits(folder, firsts, seconds)[1], logits[2]]):
        scores = {p["label"]: p["score"] for p in got}
        np.testing.assert_allclose([scores[label] for label in CLASSIFIER_LABELS], want, atol=VALUE_ATOL, rtol=0)
    status, pair = post(base, "/predict", {"model": "sentiment", "inputs": list(PAIRS[0])})  # ["a", "b"]: a pair
    assert status == 200
    np.testing.assert_allclose(sorted(p["score"] for p in pair), np.sort(pair_probs[0]), atol=VALUE_ATOL, rtol=0)
    status, err = post(base, "/predict", {"model": "sentiment", "inputs": TEXTS[4], "truncate": False})
    assert status == 413 and "inputs[0]" in err["error"], err
    status, err = post(base, "/predict", {"model": "sentiment", "inputs": ["a", "b", "c"]})
    assert status == 422 and "pair" in err["error"]
    # where the answered ones went: in the gateway the single text and the short pair (the batch
    # holds PAIRS[1], 4,400 characters, over --gateway-tokenize-chars); else all of them
    assert tokenized_inputs(base).get(where, 0.0) - before >= (1 + 2 if where == "gateway" else 1 + 4 + 2)


def test_vllm_classify(gateway, folders):
    base, _, _ = gateway
    folder = folders["xlmr"]
    probs = reference_probs(folder, reference_logits(folder, TEXTS))
    status, out = post(base, "/classify", {"model": "topics", "input": TEXTS})
    assert status == 200, out
    assert [d["index"] for d in out["data"]] == list(range(len(TEXTS)))
    np.testing.assert_allclose([d["probs"] for d in out["data"]], probs, atol=VALUE_ATOL, rtol=0)
    assert [d["label"] for d in out["data"]] == [TOPICS[j] for j in probs.argmax(axis=1)]
    assert all(d["num_classes"] == 3 for d in out["data"]) and out["usage"]["prompt_tokens"] > len(TEXTS)
    status, err = post(base, "/classify", {"model": "sentiment", "input": "x", "truncate": "sideways"})
    assert status == 400, err
    status, err = post(base, "/embed", {"model": "topics", "inputs": "x"})
    assert status == 400 and "classify model" in err["error"]
    with urllib.request.urlopen(f"{base}/info?model=topics", timeout=30) as r:
        info = json.loads(r.read())
    assert info["model_type"] == {"classifier": {"id2label": {str(i): label for i, label in enumerate(TOPICS)},
                                                 "label2id": {label: i for i, label in enumerate(TOPICS)}}}  # TEI's
