"""Fuzz a running pergola server over HTTP and gRPC: malformed JSON bodies, the binary-data
extension with lying sizes, raw gRPC tensors of random types, shapes, sizes and encodings.

Every reply must be an error (HTTP 4xx/5xx, a gRPC status) or a correct answer, the server must
stay ready, and a good request after each bad one must be answered correctly.

    python perf/fuzz_server.py --http localhost:8000 --grpc localhost:8001 --cases 5000

tests/test_fuzz.py runs a few hundred cases against the test server on every `make test`.
Two inputs that crash Triton 2.51's HTTP server itself are left out (TRITON_CRASHES; Triton's,
not pergola's: `pergola serve` restarts the server after them, tests/test_hardening.py): JSON
bodies over ~4 MiB (Triton issue #5840) and a JSON numeric input whose shape claims ~2^40
elements (Triton allocates the claimed size: std::bad_alloc, abort). Here JSON bodies stay under
1 MB and claimed shapes under 2^20 elements.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
             "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": object}
# (path, body) of single requests that end Triton 2.51's process (see the docstring).
TRITON_CRASHES = {
    "json body over 4 MiB": ("/v2/models/embed/infer", json.dumps(
        {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["w" * 5_000_000]}]}).encode()),
    "json numeric shape of 2^40": ("/v2/models/{name}_encoder/infer", json.dumps(
        {"inputs": [{"name": "INPUT_IDS", "datatype": "INT64", "shape": [1, 2**40], "data": [1]},
                    {"name": "LENGTHS", "datatype": "INT32", "shape": [1, 1], "data": [1]}]}).encode()),
}
MODELS = ["embed", "{name}", "{name}_encoder", "{name}_tokenizer", "rerank", "no_such_model"]
INPUTS = ["TEXT", "PROMPT_NAME", "DIMENSIONS", "NORMALIZE", "TRUNCATE", "ENCODING", "INPUT_IDS", "LENGTHS",
          "PROMPT_LENGTHS", "TOKEN_TYPE_IDS", "QUERY", "DOCUMENTS", "TOP_N", "BOGUS"]
STRINGS = ["hello", "", "a" * 300, "\u00e9t\u00e9", "\U0001F680", "x\x00y", "query", "float16", "binary",
           "int8", "nope", " " * 5]


@dataclass
class Tally:
    cases: int = 0
    errors: int = 0  # the server refused the case (expected for almost all)
    answered: int = 0  # a 200 / OK reply, checked for correctness
    bad: list[str] = field(default_factory=list)  # wrong answers, crashes, server not ready


def random_array(rng: random.Random, dtype_name: str) -> np.ndarray:
    shape = [rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(rng.choice([0, 1, 1, 2, 3]))]
    n = int(np.prod(shape)) if shape else 1
    if dtype_name == "BYTES":
        items = [rng.choice(STRINGS).encode() if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(5))
                 for _ in range(n)]
        return np.array(items, dtype=object).reshape(shape)
    if dtype_name == "BOOL":
        return np.array([rng.random() < 0.5 for _ in range(n)], dtype=bool).reshape(shape)
    dtype = DATATYPES[dtype_name]
    values = [rng.choice([0, 1, -1, 3, 101, 102, 7592, 30522, 2**31 - 1, -(2**31)]) for _ in range(n)]
    with np.errstate(all="ignore"):
        return np.array(values).astype(dtype).reshape(shape)


def json_value(array: np.ndarray) -> list:
    if array.dtype == object:
        return [b.decode("utf-8", "replace") for b in array.reshape(-1)]
    return array.reshape(-1).tolist()


# --- HTTP -------------------------------------------------------------------------------------
def http_request(host: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    h, port = host.rsplit(":", 1)
    conn = http.client.HTTPConnection(h, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_case(rng: random.Random, name: str) -> tuple[str, bytes, dict[str, str]]:
    """(path, body, headers) of one malformed or random HTTP inference request."""
    model = rng.choice(MODELS).format(name=name)
    path = f"/v2/models/{model}/infer"
    kind = rng.randrange(8)
    inputs = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        dt = rng.choice(list(DATATYPES))
        array = random_array(rng, dt)
        inputs.append({"name": rng.choice(INPUTS), "datatype": rng.choice([dt, dt, dt, "STRING", "FP8", ""]),
                       "shape": list(array.shape) if rng.random() < 0.8 else [rng.choice([-1, 0, 5, 2**20])],
                       "data": json_value(array) if rng.random() < 0.9 else rng.choice([None, "x", {}, [[1], 2]])})
    if kind == 0:  # not JSON at all
        return path, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), {}
    if kind == 1:  # JSON of the wrong shape
        return path, json.dumps(rng.choice([[], {"inputs": {}}, {"inputs": "x"}, {"inputs": [1]}, 7, None])).encode(), {}
    if kind == 2:  # truncated JSON
        body = json.dumps({"inputs": inputs}).encode()
        return path, body[:rng.randrange(max(1, len(body)))], {}
    if kind in (3, 4):  # binary-data extension, sizes that may lie
        return binary_case(rng, path, inputs)
    if kind == 6 and rng.random() < 0.5:  # a valid request, so that answers get checked too
        texts = rng.choices(STRINGS, k=rng.randint(1, 4))
        return f"/v2/models/{rng.choice(['embed', name])}/infer", json.dumps(
            {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}).encode(), {}
    if kind == 5:  # invalid UTF-8 inside a JSON string
        body = json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": ["@@"]}]}).encode()
        return path, body.replace(b"@@", b"\xff\xfe"), {}
    return path, json.dumps({"inputs": inputs, "outputs": [{"name": rng.choice(["EMBEDDING", "NOPE"])}]
                             if rng.random() < 0.3 else []}).encode(), {}


def binary_case(rng: random.Random, path: str, inputs: list[dict]) -> tuple[str, bytes, dict[str, str]]:
    blobs = []
    for item in inputs:
        raw = bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 8, 16, 40])))
        if item["datatype"] == "BYTES" and rng.random() < 0.5:  # a length prefix that may lie
            raw = struct.pack("<I", rng.choice([len(raw), len(raw) + 100, 2**31])) + raw
        item.pop("data", None)
        item["parameters"] = {"binary_data_size": rng.choice([len(raw), len(raw) + 7, max(0, len(raw) - 3), 2**40])}
        blobs.append(raw)
    header = json.dumps({"inputs": inputs}).encode()
    claimed = rng.choice([len(header), len(header) + 5, max(0, len(header) - 5), 2**33])
    return path, header + b"".join(blobs), {"Inference-Header-Content-Length": str(claimed),
                                            "Content-Type": "application/octet-stream"}


# --- gRPC -------------------------------------------------------------------------------------
def grpc_case(rng: random.Random, name: str) -> Any:
    """A raw ModelInferRequest: random tensors, raw contents whose sizes may lie."""
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=rng.choice(MODELS).format(name=name))
    if rng.random() < 0.15:  # a valid request, so that answers get checked too
        texts = [t.encode() for t in rng.choices(STRINGS, k=rng.randint(1, 4))]
        req.model_name = rng.choice(["embed", name])
        tensor = req.inputs.add(name="TEXT", datatype="BYTES")
        tensor.shape.append(len(texts))
        req.raw_input_contents.append(b"".join(struct.pack("<I", len(t)) + t for t in texts))
        return req
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        dt = rng.choice(list(DATATYPES))
        array = random_array(rng, dt)
        tensor = req.inputs.add(name=rng.choice(INPUTS), datatype=rng.choice([dt, dt, "BF16", "X"]))
        tensor.shape.extend(list(array.shape) if rng.random() < 0.8 else [rng.choice([-3, 0, 9, 2**40])])
        if dt == "BYTES":
            raw = b"".join(struct.pack("<I", len(b)) + b for b in array.reshape(-1))
        else:
            raw = array.tobytes()
        if rng.random() < 0.3:  # lie: cut, pad, or a length prefix past the end
            raw = rng.choice([raw[:-1], raw + b"\x00" * 3, struct.pack("<I", 2**30) + raw])
        req.raw_input_contents.append(raw)
    if rng.random() < 0.1:
        req.raw_input_contents.append(b"extra")
    return req


def grpc_call(stub: Any, request: Any) -> tuple[bool, Any]:
    import grpc

    try:
        return True, stub.ModelInfer(request, timeout=60)
    except grpc.RpcError as e:
        return False, e


# --- the run ------------------------------------------------------------------------------------
def run(http_url: str, grpc_url: str, name: str, cases: int, seed: int,
        check_good: Callable[[], str | None], check_answer: Callable[[str, Any], str | None],
        progress: bool = False) -> Tally:
    """`check_good()` sends a good request and returns a problem or None; `check_answer(model,
    reply)` judges a fuzz case that was answered (None: correct)."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    rng = random.Random(seed)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_url))
    tally = Tally()
    for i in range(cases):
        tally.cases += 1
        if rng.random() < 0.5:
            path, body, headers = http_case(rng, name)
            try:
                status, reply = http_request(http_url, path, body, headers)
            except (OSError, http.client.HTTPException) as e:
                tally.bad.append(f"case {i}: HTTP connection failed ({e}): {path} {body[:200]!r} {headers}")
                break
            if status == 200:
                tally.answered += 1
                problem = check_answer(path.split("/")[3], json.loads(reply))
                if problem:
                    tally.bad.append(f"case {i}: {path}: {problem}")
            else:
                tally.errors += 1
        else:
            request = grpc_case(rng, name)
            ok, reply = grpc_call(stub, request)
            if ok:
                tally.answered += 1
                problem = check_answer(request.model_name, reply)
                if problem:
                    tally.bad.append(f"case {i}: gRPC {request.model_name}: {problem}")
            else:
                tally.errors += 1
        problem = check_good()
        if problem:
            tally.bad.append(f"after case {i}: {problem}")
            break
        if progress and i % 100 == 0:
            print(f"{i} cases, {tally.errors} refused, {tally.answered} answered, {len(tally.bad)} bad", flush=True)
    return tally


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--http", default="localhost:8000")
    p.add_argument("--grpc", default="localhost:8001")
    p.add_argument("--name", default="all-MiniLM-L6-v2", help="the served model name (NAME_encoder, ...)")
    p.add_argument("--cases", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "client"))
    from pergola_client import PergolaClient

    client = PergolaClient(args.grpc)
    expected = client.embed(["a good request"])

    def check_good() -> str | None:
        try:
            out = client.embed(["a good request"])
        except Exception as e:  # noqa: BLE001
            return f"the good request failed: {e}"
        return None if np.allclose(out, expected, atol=1e-3) else "the good request got another answer"

    t0 = time.monotonic()
    tally = run(args.http, args.grpc, args.name, args.cases, args.seed, check_good,
                lambda model, reply: None, progress=True)
    print(json.dumps({"cases": tally.cases, "refused": tally.errors, "answered": tally.answered,
                      "bad": tally.bad[:20], "seconds": round(time.monotonic() - t0, 1)}, indent=1))
    raise SystemExit(1 if tally.bad else 0)


if __name__ == "__main__":
    main()
