"""A bounded fuzz run (perf/fuzz_server.py): 60 malformed HTTP bodies and gRPC
tensors against the test server; it stays ready, every reply is an error or a correct answer,
and the good request after each bad one is answered correctly."""

from __future__ import annotations

from typing import Any

import fuzz_server
import numpy as np
from conftest import MIN_COSINE, TEXTS, cosine_rows

CASES = 60  # each case and its good request ~0.3 s on the 2-core host; longer: perf/fuzz_server.py --cases N


def embeddings_of(reply: Any) -> np.ndarray | None:
    """EMBEDDING of an HTTP JSON reply or a gRPC ModelInferResponse, or None if absent."""
    if isinstance(reply, dict):
        out = next((o for o in reply.get("outputs", []) if o["name"] == "EMBEDDING"), None)
        return None if out is None else np.array(out["data"], dtype=np.float32).reshape(out["shape"])
    for i, out in enumerate(reply.outputs):
        if out.name == "EMBEDDING":
            return np.frombuffer(reply.raw_output_contents[i], dtype=np.float32).reshape(list(out.shape))
    return None


def test_fuzzed_requests_get_errors_or_right_answers(server, st_model, reference):
    from pergola_client import PergolaClient

    client = PergolaClient(server.grpc_url, model="embed")

    def check_good() -> str | None:
        try:
            out = client.embed(TEXTS[:2])
        except Exception as e:  # noqa: BLE001
            return f"the good request failed: {e}"
        if not client.is_ready():
            return "the server is not ready"
        return None if cosine_rows(out, reference[:2]).min() >= MIN_COSINE else "the good request got a wrong answer"

    # Every text the fuzzer sends is one of STRINGS (or random bytes, refused as invalid UTF-8):
    # an answered embedding request's rows must each be one of their embeddings.
    strings = [t for t in fuzz_server.STRINGS if t]
    known = st_model.encode(strings, convert_to_numpy=True)

    def check_answer(model: str, reply: Any) -> str | None:
        emb = embeddings_of(reply)
        if emb is None or emb.size == 0:
            return None  # a reranker or tokenizer reply, or another ENCODING's output
        if not np.isfinite(emb).all():
            return "non-finite embedding values"
        if emb.ndim != 2 or emb.shape[1] != known.shape[1]:
            return None  # DIMENSIONS cut it: its values were checked as finite
        unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
        best = (unit @ (known / np.linalg.norm(known, axis=1, keepdims=True)).T).max(axis=1)  # [rows]
        return None if best.min() >= MIN_COSINE else f"an answered row matches no text it could be ({best.min():.4f})"

    tally = fuzz_server.run(f"127.0.0.1:{server.http_url.rsplit(':', 1)[1]}", server.grpc_url, "minilm", CASES,
                            seed=1234, check_good=check_good, check_answer=check_answer)
    print(f"{tally.cases} cases: {tally.errors} refused, {tally.answered} answered")
    assert not tally.bad, tally.bad[:5]
    assert tally.cases == CASES and server.alive()
    assert tally.errors > CASES // 2  # the generator does produce malformed requests
