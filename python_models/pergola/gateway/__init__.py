"""The gateway: the HTTP APIs embedding and rerank clients already speak, in front of Triton.

    client --HTTP/JSON--> gateway (Starlette on uvicorn, one event loop per worker)
                              |  parse + check limits (http.py, the route's module)
                              |  admit or refuse (429 / 413) before any work (admission.py)
                              |  short request: tokenize here (tokenizers.py) --> NAME_encoder
                              |  otherwise: cut into chunks (backend.py) -------> the ensemble, or
                              |                         NAME_tokenizer then NAME_encoder (bulk)
                              +--HTTP, binary tensors (triton_http.py)--> Triton replica 1 .. N
                                 bulk to NAME_encoder over gRPC (cancellable) (replicas.py)
                                 (readiness, configs, index: gRPC)

OpenAI `/v1/embeddings` (openai_api.py), Cohere/Jina `/v1/rerank` (rerank_api.py), Cohere
`/v2/embed` (cohere_api.py), TEI `/embed`, `/rerank`, `/`, `/similarity`, `/info`, `/health`
(tei_api.py), vLLM's fields and `/score` (vllm_api.py); the route table in app.py, every route and
field in docs/api.md; keys and envelopes in http.py and errors.py; the served models are read
from Triton (catalog.py). `pergola serve` starts it beside tritonserver
(port 8080); `pergola gateway --triton HOST:PORT,...` runs it alone.
"""
