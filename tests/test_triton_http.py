"""The gateway's HTTP client to Triton (gateway/triton_http.py) against a scripted KServe v2
server on loopback: what it sends, how it reads binary answers, and what it does when a
connection is refused, closed while idle, lost mid-answer or too slow. The same client against
a real tritonserver is covered by tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from pergola.gateway.errors import from_triton
from pergola.gateway.triton_http import Tensor, TritonHTTP
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor


class FakeTriton:
    """Answers each request by the next action of its script (default "ok"): "ok" (sum of
    INPUT_IDS as FP32 OUT [1, 1] and TEXT echoed as BYTES NAMES), "ok_then_close" (the same,
    then closes the connection as an idle keep-alive timeout would), "status:CODE:MESSAGE",
    "die" (half an answer, then the connection drops), "slow" (no answer for 5 s)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[tuple[str, dict, dict]] = []  # (path, headers, the JSON header)
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split()[1]
                headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers["content-length"]))
                n = int(headers["inference-header-content-length"])
                request = json.loads(body[:n])
                self.requests.append((path, headers, request))
                action = self.script.pop(0) if self.script else "ok"
                if not await self.answer(writer, action, request, memoryview(body)[n:]):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):  # (CancelledError: torn down)
            pass
        writer.close()

    async def answer(self, writer: asyncio.StreamWriter, action: str, request: dict, raw: memoryview) -> bool:
        if action == "slow":
            await asyncio.sleep(5)
            return False
        if action.startswith("status:"):
            _, code, message = action.split(":", 2)
            body = json.dumps({"error": message}).encode()
            writer.write(f"HTTP/1.1 {code} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            return True
        tensors, offset = {}, 0
        for t in request["inputs"]:
            size = t["parameters"]["binary_data_size"]
            tensors[t["name"]] = (t, bytes(raw[offset:offset + size]))
            offset += size
        ids = np.frombuffer(tensors["INPUT_IDS"][1], dtype=np.int64)
        names = deserialize_bytes_tensor(tensors["TEXT"][1])
        out = np.array([[ids.sum()]], dtype=np.float32).tobytes()
        echoed = serialize_byte_tensor(names).item()
        header = json.dumps({"model_name": "m", "outputs": [
            {"name": "OUT", "datatype": "FP32", "shape": [1, 1], "parameters": {"binary_data_size": len(out)}},
            {"name": "NAMES", "datatype": "BYTES", "shape": [len(names)],
             "parameters": {"binary_data_size": len(echoed)}}]}).encode()
        payload = header + out + echoed
        head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nInference-Header-Content-Length: "
                f"{len(header)}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        if action == "die":
            writer.write(head + payload[:5])
            await writer.drain()
            return False
        writer.write(head + payload)
        await writer.drain()
        return action != "ok_then_close"


INPUTS = [Tensor("INPUT_IDS", np.array([[1, 2, 3]], dtype=np.int64), "INT64"),
          Tensor("TEXT", np.array([b"caf\xc3\xa9", b""], dtype=object), "BYTES")]


def run(script: list[str], calls: int = 1, timeout_s: float = 10.0, pause_s: float = 0.0, idle_s: float = 2.0,
        max_age_s: float = 5.0):
    """`calls` sequential infer calls against a FakeTriton with `script` -> (answers or errors, server)."""

    async def main():
        fake = FakeTriton()
        fake.script = list(script)
        client = TritonHTTP(await fake.start(), idle_s=idle_s, max_age_s=max_age_s)
        out = []
        for _ in range(calls):
            try:
                out.append(await client.infer("m", INPUTS, ["OUT", "NAMES"], version="2", timeout_s=timeout_s,
                                              headers={"pergola-api-key": "k"}))
            except InferenceServerException as e:
                out.append(e)
            await asyncio.sleep(pause_s)
        await client.close()
        fake.server.close()
        return out, fake

    return asyncio.run(main())


def test_request_and_answer_round_trip():
    (answer,), fake = run(["ok"])
    assert answer.as_numpy("OUT").tolist() == [[6.0]]
    assert answer.as_numpy("NAMES").tolist() == [b"caf\xc3\xa9", b""]
    assert answer.as_numpy("MISSING") is None
    path, headers, request = fake.requests[0]
    assert path == "/v2/models/m/versions/2/infer"
    assert headers["pergola-api-key"] == "k"
    assert request["parameters"] == {"timeout": 10_000_000}  # Triton is told the deadline (µs)
    assert [o["name"] for o in request["outputs"]] == ["OUT", "NAMES"]
    assert all(o["parameters"]["binary_data"] for o in request["outputs"])
    assert [(t["name"], t["datatype"], t["shape"]) for t in request["inputs"]] == [
        ("INPUT_IDS", "INT64", [1, 3]), ("TEXT", "BYTES", [2])]


def test_connections_are_kept_alive_and_reused():
    answers, fake = run(["ok"] * 5, calls=5)
    assert all(a.as_numpy("OUT").tolist() == [[6.0]] for a in answers)
    assert fake.connections == 1


def test_idle_connections_are_closed():
    """(tritonserver's shutdown waits for every HTTP connection to it to close)"""
    answers, fake = run(["ok"] * 2, calls=2, pause_s=0.3, idle_s=0.1)
    assert all(not isinstance(a, Exception) for a in answers), answers
    assert fake.connections == 2


def test_connections_end_after_their_maximum_age():
    """(and so a server told to stop under steady traffic is not held open by them)"""
    answers, fake = run(["ok"] * 3, calls=3, pause_s=0.4, max_age_s=0.25)  # 2nd call: last on the 1st connection
    assert all(not isinstance(a, Exception) for a in answers), answers
    assert fake.connections == 2


def test_a_connection_closed_while_idle_is_replaced_without_an_error():
    answers, fake = run(["ok_then_close", "ok"], calls=2, pause_s=0.05)
    assert all(not isinstance(a, Exception) for a in answers), answers
    assert fake.connections == 2 and len(fake.requests) == 2


@pytest.mark.parametrize("code,message,status", [
    (400, "TEXT[0] is an empty string", 400),
    (404, "model 'x' is not found", 404),
    (503, "this request would wait behind 9 queued tokens, about 11 s", 429),
    (503, "Request for unknown model: 'x_encoder' version 1 is not at ready state", 404),
    (400, "the request's timeout passed before it was computed", 504),  # Triton's HTTP says 400 for CANCELLED
    (500, "internal error: boom", 500),
])
def test_triton_errors_keep_their_meaning(code, message, status):
    (error,), _ = run([f"status:{code}:{message}"])
    assert isinstance(error, InferenceServerException)
    assert error.message() == message
    assert from_triton(str(error.status()), error.message()).status == status


def test_an_answer_cut_off_is_a_lost_connection_and_not_sent_again():
    (error, after), fake = run(["die", "ok"], calls=2)
    assert isinstance(error, InferenceServerException) and str(error.status()).endswith("UNAVAILABLE")
    assert "lost the connection" in error.message()
    assert after.as_numpy("OUT").tolist() == [[6.0]]
    assert len(fake.requests) == 2  # the cut-off call was not repeated


def test_a_slow_answer_is_a_deadline_error():
    (error,), _ = run(["slow"], timeout_s=0.3)
    assert str(error.status()).endswith("DEADLINE_EXCEEDED")
    assert from_triton(str(error.status()), error.message()).status == 504


def test_a_refused_connection_names_the_option():
    from pergola.triton.server import free_port

    async def main():
        client = TritonHTTP(f"127.0.0.1:{free_port()}")
        with pytest.raises(InferenceServerException) as err:
            await client.infer("m", INPUTS, ["OUT"], timeout_s=5)
        return err.value

    error = asyncio.run(main())
    assert str(error.status()).endswith("UNAVAILABLE") and "--triton-http-port" in error.message()
