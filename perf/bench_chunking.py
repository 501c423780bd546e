"""Long documents embedded as chunks (`chunking`, docs/long-documents.md) against the same windows
sent as plain inputs, through the gateway as `pergola serve` runs it.

    python perf/bench_chunking.py --model minilm --out perf/out/chunking.json                 # CPU, small
    python perf/bench_chunking.py --model gte-modernbert --docs 200 --words 3000 --tokens 256 \\
        --overlap 32 --clients 4 --out perf/out/chunking_gpu.json                             # a GPU

A corpus of --docs documents of --words words (Python's own documentation, pydoc's topics, cut
into consecutive pieces) is sent by --clients client threads, --docs-per-request documents a
request, in four ways, each timed after a warm-up pass:
  each    `chunking: {tokens, overlap, pooling: each}`: a vector per window
  mean    the same windows, one token-weighted mean per document
  late    the same chunks pooled from one encoding of each document (windows of the model's length)
  plain   the windows of `each` (their texts, cut at the spans `each` answered) as plain inputs,
          every window of the same documents in one request: what a client that splits itself sends
Figures: chunks per second (windows for each, mean, plain; chunks for late), tokens encoded per
second, the requests' p50 / p99; and the check that `plain` and `each` give the same vectors.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import pergola_stack, tokenizes_texts  # noqa: E402
from bench_server import NAME  # noqa: E402
from common import cosine_min, drain, model_folder, percentiles, write_result  # noqa: E402
from inputs import corpus_text  # noqa: E402

MODES = ("each", "mean", "late", "plain")


def documents(count: int, words: int) -> list[str]:
    """`count` documents of `words` consecutive words of the corpus (wrapping around it)."""
    corpus = corpus_text().split()
    return [" ".join(corpus[(i * words + j) % len(corpus)] for j in range(words)) for i in range(count)]


def post(conn: http.client.HTTPConnection, body: dict, retries: list[int] | None = None) -> dict:
    """One /v1/embeddings request -> its answer; a 429 / 503 is retried after its Retry-After, as a
    client would (counted in `retries`), and a keep-alive connection the gateway closed reopened."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    for attempt in range(100):
        try:
            conn.request("POST", "/v1/embeddings", raw, {"Content-Type": "application/json"})
            response = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if attempt:
                raise
            continue
        out = json.loads(response.read())
        if response.status in (429, 503):
            if retries is not None:
                retries.append(1)
            time.sleep(float(response.getheader("Retry-After") or 1))
            continue
        if response.status != 200:
            raise RuntimeError(f"the gateway answered {response.status}: {str(out)[:300]}")
        return out
    raise RuntimeError("refused 100 times")


def bodies(docs: list[str], windows: list[list[str]], mode: str, per_request: int, chunking: dict) -> list[dict]:
    """The requests of `mode`: `per_request` documents each (plain: their windows' texts)."""
    out = []
    for a in range(0, len(docs), per_request):
        if mode == "plain":
            out.append({"model": NAME, "input": [w for ws in windows[a:a + per_request] for w in ws]})
        else:
            out.append({"model": NAME, "input": docs[a:a + per_request],
                        "chunking": chunking | {"pooling": mode}})
    return out


def timed(port: int, requests: list[dict], clients: int) -> dict:
    """Every request once over `clients` threads (a keep-alive connection each), after a warm-up pass."""
    ms: list[float] = []
    counts = {"chunks": 0, "tokens": 0}
    retries: list[int] = []
    lock = threading.Lock()

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def one(body: dict) -> None:
            t0 = time.perf_counter()
            out = post(conn, body, retries)
            with lock:
                ms.append((time.perf_counter() - t0) * 1e3)
                counts["chunks"] += sum(d.get("chunks", 1) for d in out["data"])
                counts["tokens"] += out["usage"]["prompt_tokens"]
        return one

    drain(requests, clients, client)  # warm-up: tokenizers loaded, graphs captured
    ms.clear()
    retries.clear()
    counts.update(chunks=0, tokens=0)
    wall = drain(requests, clients, client)
    if len(ms) != len(requests):
        raise RuntimeError(f"{len(requests) - len(ms)} of {len(requests)} requests failed (see above)")
    return {"chunks": counts["chunks"], "tokens": counts["tokens"], "seconds": wall, "retries_429": len(retries),
            "chunks_per_s": counts["chunks"] / wall, "tokens_per_s": counts["tokens"] / wall,
            "requests": len(requests), "latency_ms": percentiles(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm", help="minilm, gte-modernbert, qwen3-0.6b, ... (perf/common.py)")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--words", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=128, help="chunking.tokens")
    p.add_argument("--overlap", type=int, default=16, help="chunking.overlap")
    p.add_argument("--docs-per-request", type=int, default=1)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--gpu", action="store_true", help="the encoder on the GPU (default: when one is visible)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="perf/out/chunking.json")
    args = p.parse_args()

    import pergola
    import torch

    gpu = args.gpu or torch.cuda.is_available()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pergola-chunking-"))
    folder = model_folder(args.model, workdir)
    docs = documents(args.docs, args.words)
    chunking = {"tokens": args.tokens, "overlap": args.overlap}
    res: dict = {"command": " ".join(sys.argv), "pergola": str(Path(pergola.__file__).parent),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": "gpu" if gpu else "cpu",
                 "model": args.model, "docs": args.docs, "words": args.words, "chunking": chunking,
                 "docs_per_request": args.docs_per_request, "clients": args.clients,
                 "chars": sum(map(len, docs)), "modes": {}}
    with pergola_stack(folder, workdir, gpu) as (_, port):
        if port is None or not tokenizes_texts(port):
            raise SystemExit("the gateway did not answer, or never tokenized a text itself")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        each = [post(conn, {"model": NAME, "input": d, "chunking": chunking | {"pooling": "each"}}) for d in docs]
        windows = [[d[a:b] for a, b in (item["text_span"] for item in out["data"])] for d, out in zip(docs, each)]
        res["windows"] = sum(map(len, windows))
        print(f"{args.docs} documents, {res['chars']:,} characters, {res['windows']} windows", flush=True)
        plain = post(conn, {"model": NAME, "input": windows[0]})
        res["plain_equals_each_cosine_min"] = cosine_min(
            np.array([d["embedding"] for d in plain["data"]]), np.array([d["embedding"] for d in each[0]["data"]]))
        for mode in args.modes:
            row = res["modes"][mode] = timed(port, bodies(docs, windows, mode, args.docs_per_request, chunking),
                                              args.clients)
            print(f"{mode:>5}: {row['chunks_per_s']:8.1f} chunks/s, {row['tokens_per_s']:9.0f} tokens/s, p50 "
                  f"{row['latency_ms']['p50']:.0f} ms, p99 {row['latency_ms']['p99']:.0f} ms", flush=True)
    if "plain" in res["modes"]:
        for mode in ("each", "mean", "late"):
            if mode in res["modes"]:
                res["modes"][mode]["vs_plain"] = res["modes"][mode]["chunks_per_s"] / res["modes"]["plain"]["chunks_per_s"]
    write_result(res, args.out)


if __name__ == "__main__":
    main()
