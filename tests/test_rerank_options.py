"""What pergola.text.rerank owns besides tokenization (the reranker kind, the ranking, TOP_N), and the
typed options the Triton adapters decode from a request. CPU, no server."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from pergola.config.hf_folder import ModelFolderError, load_model_spec
from pergola.config.reranker import answer_ids, reranker_kind
from pergola.text.errors import RequestError
from pergola.text.rerank import RerankOptions, rank
from pergola.triton.adapter import EmbedOptions, embed_options, rerank_options


def test_rank_is_best_first_with_ties_in_input_order():
    scores = np.array([0.2, 0.9, 0.5, 0.9, 0.1], dtype=np.float32)
    assert rank(scores).tolist() == [1, 3, 2, 0, 4]
    assert rank(scores, top_n=2).tolist() == [1, 3]
    assert rank(scores, top_n=50).tolist() == [1, 3, 2, 0, 4]
    assert rank(scores).dtype == np.int32


def test_top_n_must_not_be_negative():
    assert RerankOptions().top_n == 0
    with pytest.raises(RequestError, match="TOP_N=-2 must be positive"):
        RerankOptions(-2)


def test_reranker_kind_follows_the_architecture(minilm_folder):
    spec = load_model_spec(minilm_folder)
    with pytest.raises(ValueError, match="not as a reranker"):
        reranker_kind(spec)
    assert reranker_kind(replace(spec, task="rerank")) == "cross-encoder"
    assert reranker_kind(replace(spec, task="rerank", architecture="qwen3")) == "qwen3-reranker"


def test_answer_ids_are_the_tokenizers_and_their_absence_is_refused(minilm_folder, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    spec = replace(load_model_spec(minilm_folder), task="rerank", architecture="qwen3")
    whole = Tokenizer.from_file(str(spec.tokenizer_file))
    assert answer_ids(spec) == (whole.token_to_id("no"), whole.token_to_id("yes"))
    Tokenizer(WordLevel({"[UNK]": 0, "yes": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ModelFolderError, match="no 'yes'/'no' tokens"):
        answer_ids(replace(spec, path=tmp_path))


class FakeTensor:
    def __init__(self, value) -> None:
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return np.array([self.value])


def fake_request(**inputs) -> tuple[SimpleNamespace, dict]:
    pb_utils = SimpleNamespace(get_input_tensor_by_name=lambda request, name: request.get(name))
    return pb_utils, {name: FakeTensor(value) for name, value in inputs.items()}


def test_options_are_decoded_into_typed_objects():
    pb_utils, request = fake_request(DIMENSIONS=np.int32(32), NORMALIZE=np.bool_(False))
    options = embed_options(pb_utils, request, hidden=384, default_normalize=True)
    assert options == EmbedOptions(dimensions=32, normalize=False, encoding="float32", outputs=("dense",))
    pb_utils, request = fake_request(TOP_N=np.int32(3))
    assert rerank_options(pb_utils, request) == RerankOptions(3)
    pb_utils, request = fake_request()
    assert rerank_options(pb_utils, request) == RerankOptions(0)
    with pytest.raises(RequestError, match="TOP_N=-1"):
        rerank_options(*fake_request(TOP_N=np.int32(-1)))
