"""The gateway's pure pieces without servers: chunking, Triton error mapping, and how the replica
pool spreads calls and retries them."""

from __future__ import annotations

import asyncio

import pytest
from pergola.gateway import replicas
from pergola.gateway.backend import chunks
from pergola.gateway.errors import GatewayError, from_triton
from tritonclient.utils import InferenceServerException


@pytest.mark.parametrize("sizes,max_items,max_size,expected", [
    ([], 3, 100, []),
    ([1] * 7, 3, 100, [(0, 3), (3, 6), (6, 7)]),
    ([40, 40, 40, 10], 10, 100, [(0, 2), (2, 4)]),
    ([500, 1, 1], 10, 100, [(0, 1), (1, 3)]),  # a text over the size is a chunk of its own
    ([1, 500, 1], 10, 100, [(0, 1), (1, 2), (2, 3)]),
])
def test_chunks_cover_every_item_once_in_order(sizes, max_items, max_size, expected):
    got = chunks(sizes, max_items, max_size)
    assert got == expected
    assert [i for a, b in got for i in range(a, b)] == list(range(len(sizes)))


@pytest.mark.parametrize("status,message,code", [
    ("StatusCode.INVALID_ARGUMENT", "TEXT[0] is an empty string", 400),
    ("StatusCode.INVALID_ARGUMENT", "TEXT[0] is 9 characters; the limit is 5 characters (max_text_chars)", 413),
    ("StatusCode.INVALID_ARGUMENT", "Request for unknown model: 'x' is not found", 404),
    # a version swapped out (not a replica that is down: no other replica is tried for it)
    ("StatusCode.UNAVAILABLE", "Request for unknown model: 'x_encoder' version 1 is not at ready state", 404),
    ("StatusCode.INVALID_ARGUMENT", "unknown prompt name 'unknown model'; this model's prompts: none", 400),
    ("StatusCode.UNAVAILABLE", "this request would wait behind 9 queued tokens, about 11 s", 429),
    ("StatusCode.UNAVAILABLE", "Exceeds maximum queue size", 429),
    ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", 503),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", 504),
    # the encoder's CANCELLED past a deadline, as Triton's HTTP door answers it (400 -> INVALID_ARGUMENT)
    ("StatusCode.INVALID_ARGUMENT", "the request's timeout passed before it was computed", 504),
    ("StatusCode.CANCELLED", "the request was cancelled by its client", 504),
    ("StatusCode.INTERNAL", "boom", 500),
    # a model instance whose stub process died (Triton 2.51's words, over HTTP and gRPC): away, not broken
    ("StatusCode.INTERNAL", "in ensemble 'a', Stub process 'a_tokenizer_0_1' is not healthy.", 503),
    ("StatusCode.INTERNAL", "Failed to process the request(s) for model instance 'a_encoder_0_0', message: "
                            "Stub process 'a_encoder_0_0' is not healthy.", 503),
])
def test_triton_errors_map_to_the_status_clients_retry_on(status, message, code):
    error = from_triton(status, message)
    assert error.status == code and error.message.startswith(message)
    assert ("Retry-After" in error.headers()) == (code in (429, 503))


class FakeClient:
    """Answers with what its script says: a value, or an error (gRPC status name, message)."""

    def __init__(self, address: str) -> None:
        self.address, self.script, self.calls = address, [], 0

    async def close(self) -> None:
        pass


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(replicas, "connect", FakeClient)
    return replicas.ReplicaPool(["10.0.0.1:8001", "10.0.0.2:8001"])


async def answer(replica: replicas.Replica, delay: float = 0.0):
    client = replica.client
    client.calls += 1
    await asyncio.sleep(delay)
    outcome = client.script.pop(0) if client.script else "ok"
    if isinstance(outcome, tuple):
        raise InferenceServerException(msg=outcome[1], status=outcome[0])
    return client.address


def test_calls_spread_over_replicas_by_outstanding_calls(pool):
    async def main():
        return await asyncio.gather(*(pool.call(lambda c: answer(c, 0.01)) for _ in range(8)))

    got = asyncio.run(main())
    assert sorted(got) == ["10.0.0.1:8001"] * 4 + ["10.0.0.2:8001"] * 4
    assert all(r.outstanding == 0 for r in pool.replicas.values())


@pytest.mark.parametrize("error", [("StatusCode.UNAVAILABLE", "Exceeds maximum queue size"),
                                   ("StatusCode.UNAVAILABLE", "failed to connect to all addresses")])
def test_a_refused_or_lost_call_is_tried_on_the_next_replica(pool, error):
    first, second = pool.replicas.values()
    first.client.script, second.client.script = [error], []
    assert asyncio.run(pool.call(answer)) == second.address
    assert first.client.calls == 1 and second.client.calls == 1
    down = "connect" in error[1]
    assert (first.down_until > 0) == down  # a lost replica is left out of new calls for a moment
    if down:
        assert asyncio.run(pool.call(answer)) == second.address


def test_bad_input_is_not_retried_and_all_refusals_say_busy(pool):
    first, second = pool.replicas.values()
    first.client.script = [("StatusCode.INVALID_ARGUMENT", "TEXT[0] is an empty string")]
    with pytest.raises(GatewayError) as err:
        asyncio.run(pool.call(answer))
    assert err.value.status == 400 and second.client.calls == 0
    first.client.script = [("StatusCode.UNAVAILABLE", "Exceeds maximum queue size")]
    second.client.script = [("StatusCode.UNAVAILABLE", "failed to connect to all addresses")]
    with pytest.raises(GatewayError) as err:
        asyncio.run(pool.call(answer))
    assert err.value.status == 429  # one replica was only busy: retry later


def test_addresses_are_checked():
    with pytest.raises(ValueError, match="HOST:PORT"):
        replicas.resolve("localhost")
    assert replicas.resolve("127.0.0.1:8001") == ["127.0.0.1:8001"]


def test_triton_metrics_get_a_replica_label_and_one_description():
    from pergola.gateway.triton_metrics import labelled

    text = """# HELP nv_x requests
# TYPE nv_x counter
nv_x{model="a",version="1"} 3
nv_y 2.5
"""
    described: set = set()
    first = labelled(text, "10.0.0.1:8001", described)
    second = labelled(text, "10.0.0.2:8001", described)
    assert first == ["# HELP nv_x requests", "# TYPE nv_x counter",
                     'nv_x{replica="10.0.0.1:8001",model="a",version="1"} 3', 'nv_y{replica="10.0.0.1:8001"} 2.5']
    assert second == ['nv_x{replica="10.0.0.2:8001",model="a",version="1"} 3', 'nv_y{replica="10.0.0.2:8001"} 2.5']


def test_inputs_by_tokenizer_reads_the_exposition_prometheus_writes():
    """What benchmarks and tests read from /metrics: the counter summed over tasks, by tokenizer."""
    from pergola.gateway.metrics import INPUTS, inputs_by_tokenizer
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    inputs = Counter(INPUTS._name, INPUTS._documentation, INPUTS._labelnames, registry=registry)
    inputs.labels("embed", "gateway").inc(3)
    inputs.labels("rerank", "gateway").inc(2)
    inputs.labels("embed", "triton").inc()
    assert inputs_by_tokenizer(generate_latest(registry).decode()) == {"gateway": 5.0, "triton": 1.0}
    assert inputs_by_tokenizer("") == {}


def test_short_requests_tokenize_on_the_loop_and_longer_ones_on_a_thread():
    """A query's tokenizing stays on the event loop (a thread hand-off would cost about as much);
    a longer request's goes to a tokenizing thread, so the loop keeps serving meanwhile."""
    import threading

    from pergola.gateway.tokenizers import INLINE_CHARS, LocalTokenizers

    tokenizers = LocalTokenizers(None, 0, threads=2)

    async def where(chars: int) -> str:
        return await tokenizers.run(chars, lambda: threading.current_thread().name)

    async def main() -> tuple[str, str, str, str]:
        loop_thread = threading.current_thread().name
        return loop_thread, await where(5), await where(INLINE_CHARS), await where(INLINE_CHARS + 1)

    try:
        loop_thread, short, limit, longer = asyncio.run(main())
    finally:
        tokenizers.close()
    assert short == limit == loop_thread
    assert longer.startswith("pergola-tokenize")


def test_a_refusal_on_a_tokenizing_thread_reaches_the_request():
    from pergola.gateway.tokenizers import INLINE_CHARS, LocalTokenizers
    from pergola.text.errors import RequestError

    tokenizers = LocalTokenizers(None, 0, threads=1)

    def refuse() -> None:
        raise RequestError("TEXT[0] has more than 8 tokens")

    try:
        with pytest.raises(RequestError, match="more than 8 tokens"):
            asyncio.run(tokenizers.run(INLINE_CHARS + 1, refuse))
    finally:
        tokenizers.close()


@pytest.mark.parametrize("args, message", [
    (["--triton", "localhost"], "--triton takes HOST:PORT"),
    (["--triton", "127.0.0.1:1", "--triton-http-port", "x"], "--triton-http-port takes port numbers"),
    (["--triton", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", "--triton-http-port", "8000,8001"], "2 ports for 3"),
])
def test_bad_triton_addresses_are_refused_before_serving(args, message):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pergola.cli", "gateway", "--gateway-port", "0", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_http_ports_pair_with_targets():
    assert replicas.http_ports("8000", ["a:1", "b:1"]) == [8000, 8000]
    assert replicas.http_ports("8000,9000", ["a:1", "b:1"]) == [8000, 9000]
    assert replicas.with_port("[::1]:8001", 8000) == "[::1]:8000"
