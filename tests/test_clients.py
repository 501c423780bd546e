"""The clients users run, unchanged, against `pergola serve` (conftest.served_gateway: default
limits, a key): openai, cohere, huggingface_hub, LangChain, LlamaIndex (OpenAI-like and TEI),
Haystack (OpenAI, and TEI's embedders and ranker from huggingface-api-haystack), litellm. Each one's vectors are checked against
sentence-transformers; each client's own error class for a bad field (400 -> BadRequestError)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import MIN_COSINE, TEXTS, cosine_rows
from test_rerank import DOCS, QUERY, cross_encoder_reference

pytestmark = pytest.mark.server
SCORE_ATOL = 1e-3  # a cross-encoder's score through the gateway against transformers'
SHORT = TEXTS[:6]  # (enough to cover scripts and emoji; the long ones are test_gateway.py's)


def close(vectors, reference: np.ndarray) -> bool:
    return cosine_rows(np.asarray(vectors, dtype=np.float32), reference).min() >= MIN_COSINE


@pytest.fixture(scope="module")
def url(served_gateway) -> str:
    return served_gateway.url


@pytest.fixture(scope="module")
def key(served_gateway) -> str:
    return served_gateway.key


@pytest.fixture(scope="module")
def short_reference(st_model) -> np.ndarray:
    return st_model.encode(SHORT, convert_to_numpy=True)


# --- openai -------------------------------------------------------------------------------------

def test_openai_sdk_vectors_sync_and_async(url, key, reference, st_model):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    out = client.embeddings.create(model="mini", input=TEXTS)  # (the SDK asks for base64)
    assert close([d.embedding for d in out.data], reference)
    floats = client.embeddings.create(model="mini", input=TEXTS, encoding_format="float")
    assert close([d.embedding for d in floats.data], reference)
    small = client.embeddings.create(model="embed", input=TEXTS[0], dimensions=128)
    assert len(small.data[0].embedding) == 128

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as aclient:
            return await aclient.embeddings.create(model="mini", input=TEXTS[:3])

    assert close([d.embedding for d in asyncio.run(run()).data], reference[:3])


def test_openai_sdk_answers_2048_inputs(url, key, st_model):
    """OpenAI's own maximum in one request (the default max_texts)."""
    import openai

    texts = [f"item {i}" for i in range(2048)]  # a word or two each: the count is the point, not their length
    out = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300).embeddings.create(
        model="mini", input=texts)  # (base64, the SDK's way; floats: test_openai_sdk_vectors_sync_and_async)
    assert [d.index for d in out.data] == list(range(2048))
    sample = [0, 1, 777, 2047]
    assert close([out.data[i].embedding for i in sample], st_model.encode([texts[i] for i in sample]))


def test_openai_sdk_raises_bad_request_for_a_bad_field(url, key):
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    for extra in ({"truncate_prompt_tokens": 8193}, {"embed_dtype": "fp8_e4m3"}, {"max_tokens": 8193},
                  {"embedding_type": "int4"}, {"messages": [{"role": "user", "content": "x"}]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="mini", input="x", extra_body=extra)
        assert f"`{next(iter(extra))}`" in str(e.value), (extra, e.value)
    with pytest.raises(openai.BadRequestError):  # (a type error: 422 before, UnprocessableEntityError)
        client.embeddings.create(model="mini", input=5)  # type: ignore[arg-type]


# --- cohere -------------------------------------------------------------------------------------

def test_cohere_v2_embed_every_type(url, key, short_reference):
    import cohere
    from pergola.text.encodings import quantize

    co = cohere.ClientV2(api_key=key, base_url=url)
    out = co.embed(model="mini", texts=SHORT, input_type="search_document",
                   embedding_types=["float", "int8", "uint8", "binary", "ubinary"])
    floats = np.array(out.embeddings.float_, dtype=np.float32)
    assert close(floats, short_reference) and out.texts == SHORT
    int8 = quantize(floats, "int8").astype(np.int64)
    ubinary = quantize(floats, "binary").astype(np.int64)
    assert np.array_equal(np.array(out.embeddings.int8), int8)
    assert np.array_equal(np.array(out.embeddings.uint8), int8 + 128)
    assert np.array_equal(np.array(out.embeddings.ubinary), ubinary)
    assert np.array_equal(np.array(out.embeddings.binary), ubinary - 128)
    assert out.meta.billed_units.input_tokens > len(SHORT)
    query = co.embed(model="mini", texts=SHORT[:1], input_type="search_query", embedding_types=["float"],
                     output_dimension=64)
    assert len(query.embeddings.float_[0]) == 64


def test_cohere_v1_embed_and_rerank(url, key, short_reference, rerank_folders):
    import cohere

    co = cohere.Client(api_key=key, base_url=url)
    out = co.embed(texts=SHORT, model="mini", input_type="search_query")
    assert out.response_type == "embeddings_floats" and close(out.embeddings, short_reference)
    typed = co.embed(texts=SHORT, model="mini", input_type="clustering", embedding_types=["float"])
    assert typed.response_type == "embeddings_by_type" and close(typed.embeddings.float_, short_reference)
    ranked = cohere.ClientV2(api_key=key, base_url=url).rerank(model="ce", query=QUERY, documents=DOCS, top_n=3)
    expected = cross_encoder_reference(rerank_folders["cross-encoder"], QUERY, DOCS)
    assert [r.index for r in ranked.results] == np.argsort(-expected, kind="stable")[:3].tolist()
    np.testing.assert_allclose([r.relevance_score for r in ranked.results], np.sort(expected)[::-1][:3],
                               atol=SCORE_ATOL)


def test_cohere_sdk_raises_bad_request_for_a_bad_field(url, key):
    import cohere

    co = cohere.ClientV2(api_key=key, base_url=url)
    with pytest.raises(cohere.BadRequestError, match="input_type"):
        co.embed(model="mini", texts=["x"], input_type="image")
    with pytest.raises(cohere.BadRequestError, match="embedding_types"):
        co.embed(model="mini", texts=["x"], input_type="search_query", embedding_types=["int4"])
    with pytest.raises(cohere.BadRequestError, match="max_tokens_per_doc"):
        co.rerank(model="ce", query="q", documents=["d"], max_tokens_per_doc=0)


# --- huggingface_hub, Haystack (TEI's routes) -----------------------------------------------------

def test_huggingface_hub_inference_client(url, key, short_reference, st_model):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=url, api_key=key)
    vectors = client.feature_extraction(SHORT)
    assert vectors.shape == short_reference.shape and close(vectors, short_reference)
    one = client.feature_extraction(SHORT[0], normalize=True, truncate=True, truncation_direction="left")
    assert close(one, short_reference[:1])
    similarity = client.sentence_similarity(SHORT[0], other_sentences=SHORT[1:])
    expected = cosine_rows(np.repeat(short_reference[:1], len(SHORT) - 1, 0), short_reference[1:])
    np.testing.assert_allclose(similarity, expected, atol=1e-4)


def test_haystack_embedders_and_tei_ranker(url, key, short_reference, rerank_folders):
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret
    from haystack_integrations.components.embedders.huggingface_api import (
        HuggingFaceAPIDocumentEmbedder,
        HuggingFaceAPITextEmbedder,
    )
    from haystack_integrations.components.rankers.huggingface_api import HuggingFaceTEIRanker

    token = Secret.from_token(key)
    tei = HuggingFaceAPITextEmbedder(api_type="text_embeddings_inference", api_params={"url": url}, token=token)
    assert close([tei.run(text=SHORT[0])["embedding"]], short_reference[:1])
    docs = HuggingFaceAPIDocumentEmbedder(api_type="text_embeddings_inference", api_params={"url": url},
                                          token=token).run(documents=[Document(content=t) for t in SHORT])
    assert close([d.embedding for d in docs["documents"]], short_reference)
    text = OpenAITextEmbedder(api_key=token, api_base_url=f"{url}/v1", model="mini").run(text=SHORT[0])
    assert close([text["embedding"]], short_reference[:1])
    docs = OpenAIDocumentEmbedder(api_key=token, api_base_url=f"{url}/v1", model="mini").run(
        documents=[Document(content=t) for t in SHORT])
    assert close([d.embedding for d in docs["documents"]], short_reference)
    ranked = HuggingFaceTEIRanker(url=url, token=token, top_k=3).run(query=QUERY,
                                                                   documents=[Document(content=d) for d in DOCS])
    expected = cross_encoder_reference(rerank_folders["cross-encoder"], QUERY, DOCS)
    assert [d.content for d in ranked["documents"]] == [DOCS[i] for i in np.argsort(-expected, kind="stable")[:3]]


# --- LangChain, LlamaIndex, litellm (OpenAI's and TEI's routes) ----------------------------------------

def test_langchain_openai_embeddings(url, key, short_reference):
    from langchain_openai import OpenAIEmbeddings

    # the README's form: pergola counts and truncates tokens itself, so LangChain's tiktoken is off
    embeddings = OpenAIEmbeddings(model="mini", base_url=f"{url}/v1", api_key=key, check_embedding_ctx_length=False)
    assert close(embeddings.embed_documents(SHORT), short_reference)
    assert close([embeddings.embed_query(SHORT[0])], short_reference[:1])


def test_llama_index_openai_like_and_tei(url, key, short_reference):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    like = OpenAILikeEmbedding(model_name="mini", api_base=f"{url}/v1", api_key=key)
    assert close(like.get_text_embedding_batch(SHORT), short_reference)
    tei = TextEmbeddingsInference(model_name="mini", base_url=url, auth_token=key, timeout=60)
    assert close(tei.get_text_embedding_batch(SHORT), short_reference)
    assert close([tei.get_query_embedding(SHORT[0])], short_reference[:1])


def test_litellm_embedding(url, key, short_reference, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled price list: no fetch off this host
    import litellm

    out = litellm.embedding(model="openai/mini", input=SHORT, api_base=f"{url}/v1", api_key=key)
    assert close([d["embedding"] for d in out.data], short_reference)
