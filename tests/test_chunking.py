"""`chunking` (docs/long-documents.md): windows as a reference splitter makes them, each window's
vector as sentence-transformers gives its text, `mean` as the weighted mean of those, `late` as
transformers' hidden states pooled over each chunk's tokens of the full-length forward, and the
refusals (docs/long-documents.md's examples run in tests/test_docs.py)."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
import torch
from conftest import MAX_TEXT_CHARS, MIN_COSINE, RunningServer, cosine_rows
from test_gateway import KEY, SAME_ATOL, call, port_of, start_gateway, tokenized_inputs, tokenizer_loaded

SIZE, OVERLAP = 128, 16
WORDS = ("the river rises in hills and feeds mills of a valley town before it reaches sea after many miles of "
         "farmland while maps show its salt grain wool and timber trade").split()
RARE = "unbelievably characteristically photosynthesis, electroencephalography; internationalization".split()


def long_text(words: int = 3000, seed: int = 0) -> str:
    """A text of `words` words, a few of them split by WordPiece (windows then start inside a word)."""
    rng = random.Random(seed)
    out = [rng.choice(RARE) if rng.random() < 0.06 else rng.choice(WORDS) for _ in range(words)]
    for i in range(0, words, 13):  # sentences
        out[i] = out[i].capitalize()
        out[min(i + 12, words - 1)] += "."
    return " ".join(out)


def reference_windows(tokenizer, text: str, size: int, overlap: int) -> list[tuple[int, int, int, int]]:
    """The issue's definition, written out: (first token, end token, start char, end char) per window."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    n, out, k = len(offsets), [], 0
    while k * (size - overlap) < max(n - overlap, 1):
        a = k * (size - overlap)
        b = min(a + size, n)
        out.append((a, b, offsets[a][0], offsets[b - 1][1]))
        k += 1
    return out


# --- without a server -------------------------------------------------------------------------

@pytest.mark.parametrize("n,size,overlap", [(0, 4, 0), (1, 4, 3), (4, 4, 1), (5, 4, 1), (10, 4, 0), (10, 4, 3),
                                            (11, 5, 2), (300, 128, 16)])
def test_window_starts_follow_the_definition(n, size, overlap):
    from pergola.text.chunking import window_count, window_starts

    expected, k = [], 0
    while k * (size - overlap) < max(n - overlap, 1):
        expected.append(k * (size - overlap))
        k += 1
    assert window_starts(n, size, overlap).tolist() == expected
    assert window_count(n, size, overlap) == len(expected)


def test_span_plan_means_equal_a_plain_mean_over_each_chunks_tokens():
    """Overlapping rows, a chunk of two rows across sequences, tokens no chunk pools."""
    from pergola.text.chunking import SpanPlan

    rng = np.random.default_rng(0)
    lengths = np.array([7, 5, 9], np.int32)
    hidden = rng.standard_normal((int(lengths.sum()), 6)).astype(np.float32)
    rows = np.array([[0, 1, 4], [1, 3, 6], [2, 5, 7], [2, 8, 10], [3, 13, 20]], np.int64)
    plan = SpanPlan.build(rows.reshape(-1), lengths)
    sums = np.zeros((plan.num_atoms, 6), np.float32)
    np.add.at(sums, plan.segments[plan.segments >= 0], hidden[plan.segments >= 0])
    expected = [hidden[np.concatenate([np.arange(a, b) for c, a, b in rows if c == k])].mean(0) for k in range(4)]
    np.testing.assert_allclose(plan.means(sums), np.stack(expected), rtol=1e-6, atol=1e-6)
    assert np.flatnonzero(plan.segments < 0).tolist() == [0, 7, 10, 11, 12, 20]


@pytest.mark.parametrize("rows", [[[0, 5, 9]], [[0, 2, 2]], [[1, 0, 2]], [[0, 0, 2], [2, 2, 3]], [[0, -1, 2]]])
def test_span_plan_refuses_rows_outside_one_sequence(rows):
    from pergola.text.chunking import SpanPlan
    from pergola.text.errors import RequestError

    with pytest.raises(RequestError, match="CHUNK_SPANS"):
        SpanPlan.build(np.array(rows, np.int64).reshape(-1), np.array([7, 5], np.int32))


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_folder):
    from pergola.config.engine import EngineConfig
    from pergola.text.tokenization import TextTokenizer

    cfg = EngineConfig(model_dir=str(minilm_folder), query_prompt="query: ")
    return TextTokenizer(cfg.spec(), cfg.text_limits())


def test_windows_with_a_prompt_are_the_windows_texts_with_the_prompt(minilm_tokenizer):
    """each: a window is encoded as its text with the prompt; late: the prompt's tokens lead every
    encoding window and no chunk pools them."""
    text = long_text(600)
    cut = minilm_tokenizer.chunk([text], 64, 8, prompt_name="query")
    texts = [text[a:b] for a, b in cut.spans.tolist()]
    plain = minilm_tokenizer.encode(texts, prompt_name="query")
    np.testing.assert_array_equal(cut.encoded.input_ids, plain.input_ids)
    assert (cut.encoded.prompt_lengths == plain.prompt_lengths).all()
    late = minilm_tokenizer.chunk([text], 64, 8, late=True, prompt_name="query")
    assert late.spans.tolist() == cut.spans.tolist() and late.tokens.tolist() == cut.tokens.tolist()
    prompt = minilm_tokenizer.tokenize(["query: "], add_special_tokens=False).input_ids
    starts = np.concatenate([[0], np.cumsum(late.encoded.lengths)[:-1]])
    for s in starts:
        np.testing.assert_array_equal(late.encoded.input_ids[s + 1:s + 1 + prompt.size], prompt)
    pooled = np.zeros(late.encoded.input_ids.size, bool)
    for _, a, b in late.ranges:
        pooled[a:b] = True
    assert not any(pooled[s:s + 1 + prompt.size].any() for s in starts)
    # every text token is pooled, once per chunk holding it
    assert sum(b - a for _, a, b in late.ranges) == int(late.tokens.sum())


def test_chunk_refuses_what_the_model_cannot_take(minilm_tokenizer):
    from pergola.text.chunking import ChunkLimits
    from pergola.text.errors import RequestError

    with pytest.raises(RequestError, match=r"CHUNK_SIZE\) = 255"):
        minilm_tokenizer.chunk(["x"], 255)  # MiniLM: 256 less [CLS] and [SEP]
    minilm_tokenizer.chunk(["x"], 254)
    with pytest.raises(RequestError, match=r"CHUNK_OVERLAP\) = 8"):
        minilm_tokenizer.chunk(["x"], 8, 8)
    with pytest.raises(RequestError, match=r"TEXT\[1\] makes 11 windows; the limit is 10"):
        minilm_tokenizer.chunk(["a b", "a " * 11], 1, limits=ChunkLimits(10, 100))
    with pytest.raises(RequestError, match="the limit is 12 windows a request"):
        minilm_tokenizer.chunk(["a " * 10, "a " * 10], 1, limits=ChunkLimits(10, 12))


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """A long-context folder: gte-modernbert's layout at CI size (CLS pooling, 8,192 tokens, a
    local attention window of 16), seeded random weights, FP32 on the CPU."""
    from pergola_testing import make_modernbert_folder

    return make_modernbert_folder(tmp_path_factory.mktemp("modernbert") / "model", "tiny", seed=3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_late_matches_transformers_hidden_states_over_each_chunks_tokens(modernbert, device):
    """One full-length forward of a 1,200-word text (~7,000 tokens of this folder's small
    vocabulary; a CLS model: late pools the mean), beside another request in steps of 1,024
    tokens: each chunk is the mean of transformers' last_hidden_state over its tokens (FP32 on
    the CPU: cosine >= 0.9999; BF16 on a GPU, through its lanes' buffers: >= 0.999)."""
    from pergola.config.engine import EngineConfig
    from pergola.engine import EncodeRequest, Engine
    from pergola.text.chunking import window_starts
    from pergola.text.tokenization import TextTokenizer
    from transformers import AutoModel

    cfg = EngineConfig(model_dir=str(modernbert), max_batch_tokens=1024,
                       **({} if device == "cpu" else {"device": "cuda:0", "dtype": "bfloat16"}))
    tokenizer, engine = TextTokenizer(cfg.spec(), cfg.text_limits()), Engine(cfg)
    text = long_text(1200, seed=1)
    cut = tokenizer.chunk([text], SIZE, OVERLAP, late=True)
    assert cut.sequences.tolist() == [1], "the text fits one forward pass"
    req = EncodeRequest(cut.encoded.input_ids, cut.encoded.lengths, cut.encoded.prompt_lengths)
    engine.validate(req)
    plan = engine.late_request(req, cut.ranges)
    other = EncodeRequest(cut.encoded.input_ids[:700], np.array([300, 400], np.int32))
    engine.encode([other, req])
    vectors = engine.late_vectors(req, plan)

    model = AutoModel.from_pretrained(str(modernbert), torch_dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        hidden = model(torch.from_numpy(cut.encoded.input_ids)[None]).last_hidden_state[0].numpy()
    n = int(cut.encoded.lengths[0]) - 2  # ([CLS] text [SEP])
    starts = window_starts(n, SIZE, OVERLAP)
    expected = np.stack([hidden[1 + a:1 + min(a + SIZE, n)].mean(0) for a in starts.tolist()])
    assert vectors.shape == expected.shape and len(vectors) > 20
    assert cosine_rows(vectors, expected).min() >= (0.9999 if device == "cpu" else 0.999)


def test_a_chunked_request_counts_its_windows_as_work():
    """Admission weighs the windows: the shared tokens and each window's special tokens."""
    from pergola.gateway.admission import SPECIAL_TOKENS, Load

    load = Load()
    plain = load.estimate([40_000])
    windows = load.windowed([40_000], SIZE, OVERLAP)
    n = plain - SPECIAL_TOKENS
    count = -(-(n - OVERLAP) // (SIZE - OVERLAP))
    assert windows == n + (count - 1) * OVERLAP + count * SPECIAL_TOKENS


# --- through the gateway ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def here(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    """A gateway that cuts the windows itself (it reads the repository; up to 65,536 characters),
    cutting requests into chunks of 3 windows."""
    gw = start_gateway(tmp_path_factory.mktemp("chunking-here"), server.grpc_url, "--api-key", KEY,
                       "--chunk-texts", "3", "--triton-repository", str(server.repo),
                       "--gateway-tokenize-chars", "65536", http=port_of(server.http_url))
    tokenizer_loaded(gw)  # (loaded on first use; until then texts go through Triton's tokenizer)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def there(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    """A gateway without the repository: Triton's tokenizer model cuts the windows."""
    gw = start_gateway(tmp_path_factory.mktemp("chunking-there"), server.grpc_url, "--api-key", KEY,
                       "--chunk-texts", "5")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def document() -> str:
    text = long_text(3000)
    assert len(text) < MAX_TEXT_CHARS  # (the test server's limit)
    return text


@pytest.fixture(scope="module")
def medium() -> str:
    """Long enough for what the tests of routes, codes and batching check (11 windows of 128, cut
    into several requests of 3 or 5 windows; 5 encoding windows of 254 for late), a third of
    `document`'s work: the definitions are checked on `document`."""
    return long_text(900, seed=2)


def embeddings(gw, texts, pooling: str, **extra) -> dict:
    status, out, _ = call(gw, "POST", "/v1/embeddings", {"model": "minilm", "input": texts, **extra,
                                                         "chunking": {"tokens": SIZE, "overlap": OVERLAP,
                                                                      "pooling": pooling}})
    assert status == 200, out
    return out


def vectors_of(out: dict, index: int = 0) -> np.ndarray:
    return np.array([d["embedding"] for d in out["data"] if d["index"] == index], dtype=np.float64)


def test_each_window_is_sentence_transformers_on_its_text(here, st_model, document):
    out = embeddings(here, document, "each")
    reference = reference_windows(st_model.tokenizer, document, SIZE, OVERLAP)
    assert len(reference) > 25
    assert [d["text_span"] for d in out["data"]] == [[c, d] for _, _, c, d in reference]
    assert [(d["index"], d["chunk"]) for d in out["data"]] == [(0, k) for k in range(len(reference))]
    texts = [document[c:d] for _, _, c, d in reference]
    expected = st_model.encode(texts, convert_to_numpy=True, batch_size=16)
    assert cosine_rows(vectors_of(out), expected).min() >= MIN_COSINE
    encoded = sum(len(ids) for ids in st_model.tokenizer(texts)["input_ids"])
    assert out["usage"]["prompt_tokens"] == encoded


def test_mean_is_the_token_weighted_mean_of_the_windows(here, st_model, document):
    out = embeddings(here, [document, "a short one"], "mean")
    reference = reference_windows(st_model.tokenizer, document, SIZE, OVERLAP)
    windows = st_model.encode([document[c:d] for _, _, c, d in reference], convert_to_numpy=True, batch_size=16)
    weights = np.array([b - a for a, b, _, _ in reference], np.float64)
    expected = (windows * weights[:, None]).sum(0) / weights.sum()
    expected /= np.linalg.norm(expected)  # MiniLM normalises
    assert [(d["index"], d["chunks"]) for d in out["data"]] == [(0, len(reference)), (1, 1)]
    assert cosine_rows(vectors_of(out), expected[None]).min() >= MIN_COSINE
    short = st_model.encode(["a short one"], convert_to_numpy=True)
    assert cosine_rows(vectors_of(out, 1), short).min() >= MIN_COSINE


@pytest.mark.parametrize("pooling", ["each", "mean", "late"])
def test_a_texts_vectors_do_not_depend_on_the_other_inputs(here, medium, pooling):
    alone = vectors_of(embeddings(here, medium, pooling))
    among = embeddings(here, ["short first", medium, long_text(400, seed=5)], pooling)
    np.testing.assert_allclose(vectors_of(among, 1), alone, rtol=0, atol=SAME_ATOL)


@pytest.mark.parametrize("pooling", ["each", "mean", "late"])
def test_cut_by_tritons_tokenizer_equals_cut_here(here, there, medium, pooling):
    texts = [long_text(500, seed=7), medium]
    before, before_e = tokenized_inputs(here).get("gateway", 0), tokenized_inputs(there).get("triton", 0)
    mine, theirs = embeddings(here, texts, pooling), embeddings(there, texts, pooling)
    assert tokenized_inputs(here)["gateway"] == before + 2 and tokenized_inputs(there)["triton"] == before_e + 2
    assert mine["usage"] == theirs["usage"]
    assert [{k: v for k, v in d.items() if k != "embedding"} for d in mine["data"]] == \
        [{k: v for k, v in d.items() if k != "embedding"} for d in theirs["data"]]
    for i in range(2):
        np.testing.assert_allclose(vectors_of(mine, i), vectors_of(theirs, i), rtol=0, atol=SAME_ATOL)


def late_reference(folder, tokenizer, text: str, size: int, overlap: int, budget: int) -> np.ndarray:
    """Late chunking written out with transformers: the text's tokens in windows of `budget` with
    `overlap` (a token from the window where it sits further from an edge: ownership passes in the
    middle of an overlap), each window a forward with [CLS] and [SEP], each chunk the mean of its
    tokens' last hidden states."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder)).eval()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n, hidden = len(ids), np.zeros((len(ids), model.config.hidden_size), np.float32)
    starts = [k * (budget - overlap) for k in range(-(-max(n - overlap, 1) // (budget - overlap)))]
    for j, a in enumerate(starts):
        window = [tokenizer.cls_token_id, *ids[a:a + budget], tokenizer.sep_token_id]
        with torch.no_grad():
            states = model(torch.tensor([window])).last_hidden_state[0, 1:-1].numpy()
        first = 0 if j == 0 else a + overlap // 2
        last = n if j + 1 == len(starts) else starts[j + 1] + overlap // 2
        hidden[first:last] = states[first - a:last - a]
    return np.stack([hidden[a:b].mean(0) for a, b, _, _ in reference_windows(tokenizer, text, size, overlap)])


def test_late_over_windows_of_the_models_length(here, st_model, minilm_folder, document):
    """MiniLM takes 256 tokens: the 3,000-word text is encoded in windows of 254 text tokens sharing
    16, and each chunk pools its own tokens of them (normalised, as MiniLM's vectors are)."""
    out = embeddings(here, document, "late")
    expected = late_reference(minilm_folder, st_model.tokenizer, document, SIZE, OVERLAP, 254)
    reference = reference_windows(st_model.tokenizer, document, SIZE, OVERLAP)
    assert [d["text_span"] for d in out["data"]] == [[c, d] for _, _, c, d in reference]
    assert cosine_rows(vectors_of(out), expected).min() >= MIN_COSINE
    n = len(st_model.tokenizer(document, add_special_tokens=False)["input_ids"])
    windows = -(-(n - OVERLAP) // (254 - OVERLAP))
    assert out["usage"]["prompt_tokens"] == n + (windows - 1) * OVERLAP + 2 * windows


def test_dimensions_and_embedding_types_apply_to_chunks(here, medium):
    """each and late: the encoder's codes per chunk; mean: the average in float32, then encoded."""
    for pooling in ("each", "mean", "late"):
        floats = vectors_of(embeddings(here, medium, pooling, dimensions=64))
        floats /= np.linalg.norm(floats, axis=1, keepdims=True)
        codes = embeddings(here, medium, pooling, dimensions=64, embedding_type="int8", encoding_format="base64")
        rows = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), np.int8) for d in codes["data"]])
        assert rows.shape == floats.shape
        np.testing.assert_allclose(rows, np.clip(np.rint(floats * 127), -127, 127), rtol=0, atol=1)


def test_tei_embed_takes_chunking(here, medium):
    body = {"inputs": [medium, "short"], "chunking": {"tokens": SIZE, "overlap": OVERLAP}}
    status, items, headers = call(here, "POST", "/embed", body)
    assert status == 200, items
    out = embeddings(here, [medium, "short"], "each")
    assert [(d["index"], d["chunk"], d["text_span"]) for d in items] == \
        [(d["index"], d["chunk"], d["text_span"]) for d in out["data"]]
    np.testing.assert_allclose([d["embedding"] for d in items], [d["embedding"] for d in out["data"]], rtol=0,
                               atol=SAME_ATOL)
    assert int(headers["x-total-tokens"]) == out["usage"]["prompt_tokens"]
    status, means, _ = call(here, "POST", "/embed", body | {"chunking": {"tokens": SIZE, "pooling": "mean"}})
    assert status == 200 and len(means) == 2 and len(means[0]) == 384


@pytest.mark.parametrize("extra,status,param", [
    ({"chunking": {"tokens": 255}}, 400, "chunking"),  # over MiniLM's 254
    ({"chunking": {"tokens": 0}}, 400, "chunking.tokens"),
    ({"chunking": {"tokens": 16, "overlap": 16}}, 400, "chunking.overlap"),
    ({"chunking": {"tokens": 16, "overlap": True}}, 400, "chunking.overlap"),
    ({"chunking": {"pooling": "max"}}, 400, "chunking.pooling"),
    ({"chunking": {"size": 16}}, 400, "chunking.size"),
    ({"chunking": {}, "truncate": "END"}, 400, "truncate"),
    ({"chunking": {}, "max_tokens": 64}, 400, "max_tokens"),
    ({"chunking": {}, "input": [[101, 2023, 102]]}, 400, "chunking"),
    ({"chunking": {}, "truncate_prompt_tokens": 32}, 400, "chunking"),  # vLLM's fields: cut, not windowed
    ({"chunking": {}, "embed_dtype": "float16", "encoding_format": "base64"}, 400, "chunking"),
    ({"chunking": {}, "endianness": "big", "encoding_format": "base64"}, 400, "chunking"),
    ({"chunking": {"tokens": 1}, "input": "a " * 5000}, 413, "chunking"),  # 5,000 windows, the limit 4,096
])
def test_refusals_name_the_field(here, extra, status, param):
    got, out, _ = call(here, "POST", "/v1/embeddings", {"model": "minilm", "input": "some text"} | extra)
    assert got == status, out
    assert out["error"]["param"] == param, out
    if status == 413:
        assert "max_text_chunks" in out["error"]["message"] and "input[0]" in out["error"]["message"]


def test_chunking_must_be_an_object(here):
    got, out, _ = call(here, "POST", "/v1/embeddings", {"model": "minilm", "input": "x", "chunking": "each"})
    assert got in (400, 422) and out["error"]["param"] == "chunking", out  # (Body.get's status for a wrong type)
