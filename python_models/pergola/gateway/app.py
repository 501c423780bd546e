"""The gateway's ASGI app (Starlette on uvicorn) and how it runs.

Routes and their families (error envelopes): OpenAI /v1/embeddings (TEI's alias /embeddings),
/v1/models; Cohere/Jina /v1/rerank, /v2/rerank, Cohere /v2/embed, /v1/embed; NIM /v1/ranking;
vLLM /classify, /pooling (the embed task), /score, /detokenize; TEI /embed, /embed_sparse, /embed_all, /predict, /similarity,
/decode, /vertex, /info, /health (/ping, GET /); by the body: /rerank (TEI's `texts` or Cohere's
`documents`), /tokenize (TEI's `inputs` or vLLM's `prompt`), POST / (TEI's, by the served model's
task) and /invocations (SageMaker's: any of them); OpenAI's /v1/files and /v1/batches
(gateway/batch). docs/api.md documents each route and field.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.routing import Route

from pergola.config.options import from_environment, to_environment
from pergola.config.settings import external
from pergola.gateway import (
    classify_api,
    cohere_api,
    connections,
    metrics,
    openai_api,
    rerank_api,
    tei_api,
    tracing,
    triton_metrics,
    vllm_api,
)
from pergola.gateway.admission import CancelOnDisconnect
from pergola.gateway.batch import BatchAPI
from pergola.gateway.http import Body, Keys, dispatch, endpoint
from pergola.gateway.options import GatewayOptions
from pergola.gateway.state import Gateway, api_keys, replica_targets

GatewayHandler = Callable[[Gateway, Request], Awaitable[Any]]


def build_app(opts: GatewayOptions) -> Starlette:
    tracing.require_sdk()
    holder: dict[str, Gateway] = {}
    batch = BatchAPI(opts)  # /v1/files, /v1/batches and the jobs behind them (gateway/batch)

    def bound(handler: GatewayHandler) -> Callable[[Request], Awaitable[Any]]:
        return lambda request: handler(holder["gateway"], request)

    def route(path: str, family: str, handler: GatewayHandler, method: str = "POST", key: bool = True) -> Route:
        return Route(path, endpoint(family, bound(handler), keys), methods=[method])

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway = Gateway(opts)  # inside the running loop: gRPC aio channels belong to it
        holder["gateway"] = gateway
        try:
            async with batch.running(gateway):
                yield
        finally:
            gateway.backend.tokenizers.close()
            gateway.offload.close()
            await gateway.pool.close()

    keys = Keys(api_keys(opts))

    async def rerank_either(request: Request) -> Any:
        return await tei_api.rerank_either(holder["gateway"], keys, request)

    def by_body(choose: Callable[[Gateway, Body], Awaitable[tuple[str, GatewayHandler]]],
                ids_field: str | None = None) -> Callable[[Request], Awaitable[tuple[str, Any]]]:
        """A route that speaks several APIs: the body says which (and so the error envelope)."""
        async def pick(request: Request) -> tuple[str, Callable[[Request], Awaitable[Any]]]:
            body = await holder["gateway"].body(request, ids_field)
            keys.check(request)
            chosen, handler = await choose(holder["gateway"], body)
            return chosen, bound(handler)
        return pick
    routes = [
        route("/v1/embeddings", "openai", openai_api.embeddings),
        route("/embeddings", "openai", openai_api.embeddings),  # TEI's alias
        route("/v2/embed", "cohere", cohere_api.embed_v2),
        route("/v1/embed", "cohere", cohere_api.embed_v1),
        route("/v1/models", "openai", openai_api.models, "GET"),
        route("/v1/rerank", "cohere", rerank_api.rerank_route),
        route("/v2/rerank", "cohere", rerank_api.rerank_route),
        route("/v1/ranking", "cohere", rerank_api.nim_ranking),  # NVIDIA NIM's form: logits
        Route("/rerank", rerank_either, methods=["POST"]),
        route("/embed", "tei", tei_api.embed),
        route("/embed_sparse", "tei", tei_api.embed_sparse),  # bge-m3's lexical weights
        route("/embed_all", "tei", tei_api.embed_all),  # bge-m3's ColBERT vectors
        route("/predict", "tei", tei_api.predict),
        route("/classify", "openai", classify_api.classify),  # vLLM's form
        route("/pooling", "openai", openai_api.pooling),  # vLLM's, the embed task
        route("/score", "openai", vllm_api.score),  # vLLM's
        route("/v1/score", "openai", vllm_api.score),
        route("/detokenize", "openai", vllm_api.detokenize),
        Route("/tokenize", dispatch("tei", by_body(tokenize_form)), methods=["POST"]),  # TEI's or vLLM's
        route("/similarity", "tei", tei_api.similarity),
        route("/decode", "tei", tei_api.decode),
        route("/vertex", "tei", tei_api.vertex),
        Route("/", dispatch("tei", by_body(tei_root)), methods=["POST"]),  # TEI's, by the model's task
        Route("/invocations", dispatch("tei", by_body(invocation, "input")), methods=["POST"]),  # SageMaker's
        route("/info", "tei", tei_api.info, "GET"),
        *(Route(path, endpoint("tei", bound(tei_api.health), None), methods=["GET"])
          for path in ("/health", "/ping", "/")),
        triton_metrics.route(lambda: holder["gateway"]),  # Triton's metrics text, per replica
        *batch.routes(route),
    ]
    middleware = [Middleware(metrics.RequestMetrics, paths=[r.path for r in routes] + [metrics.PATH]),
                  Middleware(tracing.TraceContext),  # gateway/metrics.py, gateway/tracing.py
                  Middleware(CancelOnDisconnect)]  # a client gone: its work stops (gateway/admission.py)
    return Starlette(routes=routes + [metrics.route()], lifespan=lifespan, middleware=middleware)


async def tokenize_form(gw: Gateway, body: Body) -> tuple[str, GatewayHandler]:
    """/tokenize: vLLM's form ({"prompt"}) or TEI's ({"inputs"})."""
    return ("openai" if vllm_api.is_vllm_tokenize(body) else "tei"), tei_api.tokenize


async def tei_root(gw: Gateway, body: Body) -> tuple[str, GatewayHandler]:
    """TEI's `POST /`: tei_api.root decides by the body and the served model's task."""
    return "tei", tei_api.root


async def invocation(gw: Gateway, body: Body) -> tuple[str, GatewayHandler]:
    """SageMaker's /invocations, as vLLM and TEI answer it: a rerank body ({"query",
    "documents"}), a /score body, an OpenAI embeddings body ({"input"}; /classify's for a
    classifier), else TEI's form (`POST /`)."""
    data = body.data
    if "query" in data and "documents" in data:
        return "cohere", rerank_api.rerank_route
    if vllm_api.is_score(body):
        return "openai", vllm_api.score
    if "input" in data or "messages" in data:
        catalog = await gw.catalog()
        name = data.get("model")
        classify = isinstance(name, str) and name in catalog and catalog[name].task == "classify"
        return "openai", classify_api.classify if classify else openai_api.embeddings
    return "tei", tei_api.root


def create_app() -> Starlette:
    """The app from PERGOLA_* environment variables (what each uvicorn worker process runs), and
    that process's connection limits."""
    opts = from_environment(GatewayOptions)
    connections.configure(opts)
    return build_app(opts)


def spawn(opts: GatewayOptions) -> subprocess.Popen:
    """`pergola gateway` as a child process that ends with its parent (`pergola serve`)."""
    from pergola.triton.server import popen_tied

    env = dict(os.environ) | to_environment(opts)
    return popen_tied([sys.executable, "-m", "pergola.cli", "gateway"], env=env)


def watch(child: subprocess.Popen, stopping: threading.Event) -> threading.Event:
    """Wait for the gateway child from a thread: when it ends while `stopping` is unset (its port
    was taken after all, a bad option, a crash), say so and send this process SIGTERM, so that
    `pergola serve` stops tritonserver and exits non-zero instead of serving without its front
    door. Returns the event set in that case."""
    failed = threading.Event()

    def wait() -> None:
        code = child.wait()
        if stopping.is_set():
            return
        failed.set()
        print(f"pergola serve: the gateway exited with code {code} (its reason is above); stopping", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="gateway-watch", daemon=True).start()
    return failed


@contextlib.contextmanager
def shared_metrics() -> Iterator[None]:
    """Worker processes that count in one place (prometheus_client's multiprocess mode, which each
    worker takes up at import): a fresh folder unless PROMETHEUS_MULTIPROC_DIR names one. Without
    it a scrape would show the counts of whichever worker answered it."""
    if external("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    folder = tempfile.mkdtemp(prefix="pergola-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(folder, ignore_errors=True)


def run(opts: GatewayOptions) -> None:
    """Serve on the options' port with the connection discipline of gateway/connections.py: the
    socket is bound here first, so a port in use ends the process with a message naming it."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    try:  # (here, not in the app's start-up, where uvicorn would print a traceback around it)
        replica_targets(opts)
        connections.configure(opts)
    except ValueError as e:
        raise SystemExit(f"pergola gateway: {e}") from None
    sock = connections.listen(opts.gateway_bind, opts.gateway_port)
    kwargs: dict[str, Any] = dict(log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                                  http=connections.GuardedProtocol, timeout_keep_alive=opts.keep_alive_timeout_s)
    if opts.gateway_workers > 1:  # workers import the app themselves: hand them the options
        os.environ.update(to_environment(opts))
        with shared_metrics():
            config = uvicorn.Config("pergola.gateway.app:create_app", factory=True, workers=opts.gateway_workers,
                                    **kwargs)
            Multiprocess(config, sockets=[sock]).run()
        return
    server = uvicorn.Server(uvicorn.Config(build_app(opts), **kwargs))
    server.run(sockets=[sock])
    if not server.started:  # (the app's start-up failed: uvicorn has said why)
        raise SystemExit(1)
