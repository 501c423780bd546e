"""The gateway's connection discipline (gateway/connections.py): idle, slowloris and stalled-body
clients are closed on their clocks, the connection cap makes room or refuses clearly, a taken port
stops `pergola gateway` and `pergola serve`, and an aborted upload is no 500. A gateway alone on
loopback (its --triton target unused: nothing here reaches Triton), short clocks through its flags."""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from pergola.gateway.connections import default_max_connections
from pergola.triton.server import free_port
from pergola.triton.supervisor import live_stubs

SLACK_S = 3.0  # what a clock may run late on a busy 2-core host
CLOCK_S = 0.5  # the `quick` gateway's clocks
CAP = 40


@dataclass
class Gateway:
    proc: subprocess.Popen
    port: int
    log: Path

    def connect(self, timeout: float = 10.0) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return s

    def get(self, path: str = "/metrics") -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=20) as r:
            return r.status, r.read().decode()


def start_gateway(tmp: Path, *args: str, lower_soft_limit: bool = False) -> Gateway:
    """`pergola gateway` on a free port; lower_soft_limit: started with a soft open-files limit
    under the hard one (as on many hosts), to see it raised."""
    port = free_port()
    log = tmp / f"gateway-{port}.log"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if lower_soft_limit:  # (inherited by the child; set here rather than in a preexec_fn)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pergola.cli", "gateway", "--triton", "127.0.0.1:1",
                                 "--gateway-port", str(port), "--gateway-bind", "127.0.0.1", "--models", "m",
                                 *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    gw = Gateway(proc, port, log)
    deadline = time.monotonic() + 60
    while True:
        try:
            gw.get()
            return gw
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


def stop(gw: Gateway) -> None:
    gw.proc.terminate()
    try:
        gw.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        gw.proc.kill()
        gw.proc.wait()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory):
    """Every clock at CLOCK_S."""
    gw = start_gateway(tmp_path_factory.mktemp("quick"), "--header-timeout-s", str(CLOCK_S), "--body-timeout-s",
                       str(CLOCK_S), "--keep-alive-timeout-s", str(CLOCK_S), lower_soft_limit=True)
    yield gw
    stop(gw)


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory):
    """At most CAP connections; bodies may take 60 s (a stalled one holds its connection)."""
    gw = start_gateway(tmp_path_factory.mktemp("capped"), "--max-connections", str(CAP),
                       "--header-timeout-s", "30", "--body-timeout-s", "60")
    yield gw
    stop(gw)


def read_until_closed(s: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (b"" from recv), and how long that took;
    fails when the connection is still open after `within_s`."""
    started, got = time.monotonic(), b""
    s.settimeout(within_s)
    while True:
        try:
            part = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {within_s:.1f} s (got {got[:200]!r})") from None
        if not part:
            return got, time.monotonic() - started
        got += part


def read_response(s: socket.socket) -> bytes:
    """One HTTP response with a content-length, read whole from a kept-alive connection; fails
    when the server closes it first."""
    def more() -> bytes:
        part = s.recv(65536)
        assert part, "the server closed the connection before its answer"
        return part

    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        body += more()
    return head


def test_an_idle_connection_is_closed_on_the_header_clock(quick):
    with quick.connect() as s:
        _, took = read_until_closed(s, CLOCK_S + SLACK_S)
    assert took >= 0.9 * CLOCK_S


def test_a_kept_alive_connection_is_closed_on_the_keep_alive_clock(quick):
    with quick.connect() as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(s).startswith(b"HTTP/1.1 200")
        _, took = read_until_closed(s, CLOCK_S + SLACK_S)
    assert took >= 0.9 * CLOCK_S


def test_a_slowloris_client_is_closed_on_the_header_clock(quick):
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"
    started = time.monotonic()
    with quick.connect() as s:
        try:
            for byte in request:  # one byte every 0.1 s: 24 s for the whole request
                s.sendall(bytes([byte]))
                time.sleep(0.1)
                assert time.monotonic() - started < CLOCK_S + SLACK_S, "the trickle was never cut"
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            raise AssertionError("the whole trickled request was accepted")
    assert 0.9 * CLOCK_S <= time.monotonic() - started < CLOCK_S + SLACK_S


def test_a_stalled_body_is_answered_408_and_closed(quick):
    with quick.connect() as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"input\": \"a")
        answer, took = read_until_closed(s, CLOCK_S + SLACK_S)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"--body-timeout-s" in answer and b"connection: close" in answer.lower()
    assert took >= 0.9 * CLOCK_S


def test_an_aborted_upload_is_no_500(quick):
    with quick.connect() as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b"[" * 5000)
        time.sleep(0.2)
    time.sleep(0.5)
    _, metrics = quick.get()
    statuses = re.findall(r'pergola_gateway_requests_total\{route="/v1/embeddings",status="(\d+)"\}', metrics)
    assert statuses == ["499"], metrics[-2000:]
    log = quick.log.read_text()
    assert "Traceback" not in log and "500" not in log and "failed" not in log, log


def test_the_open_files_limit_is_raised_to_the_hard_limit(quick):
    limits = Path(f"/proc/{quick.proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits).groups()
    assert soft == hard, limits


def test_the_default_cap_leaves_room_below_the_open_files_limit():
    assert default_max_connections(20_000) == 17_500
    assert default_max_connections(1_024) == 512
    assert default_max_connections(1 << 20) == (1 << 20) - (1 << 17)


def test_past_the_cap_the_idle_connections_make_room(capped):
    assert capped.get()[0] == 200  # below the cap
    held = [capped.connect() for _ in range(CAP + 10)]
    try:
        time.sleep(0.5)
        for s in held[:10]:  # the ten that waited longest were closed, quietly
            assert read_until_closed(s, SLACK_S)[0] == b""
        assert capped.get()[0] == 200  # a real request still gets in (another idle one makes room)
        for s in held[-CAP + 1:]:  # the newest are still open
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in held:
            s.close()


def test_a_flood_past_the_cap_closes_its_own_connections_before_a_kept_alive_client(capped):
    """A real client's kept-alive connection (answered once, now idle) is older than every flood
    connection, yet the flood's never-answered connections make room before it does."""
    time.sleep(0.5)  # (the earlier test's connections seen closed)
    get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    with capped.connect() as client:
        client.sendall(get)
        assert read_response(client).startswith(b"HTTP/1.1 200")
        flood = [capped.connect() for _ in range(2 * CAP)]  # each past the cap closes an idle one
        try:
            time.sleep(0.5)
            client.sendall(get)  # the same connection, still open
            assert read_response(client).startswith(b"HTTP/1.1 200")
            assert read_until_closed(flood[0], SLACK_S)[0] == b""  # the flood's oldest made room
        finally:
            for s in flood:
                s.close()


def test_with_every_connection_busy_a_new_one_is_refused_clearly(capped):
    time.sleep(0.5)  # (the earlier test's connections seen closed)
    busy = []
    try:
        for _ in range(CAP):  # each one a request waiting for its body: in flight, not idle
            s = capped.connect()
            s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            busy.append(s)
        time.sleep(0.5)
        with capped.connect() as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer, _ = read_until_closed(s, SLACK_S)  # a whole answer and a close, not a reset
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: 1" in answer.lower() and b"--max-connections" in answer
        busy.pop().close()
        time.sleep(0.5)
        assert capped.get()[0] == 200  # a slot freed: served again
    finally:
        for s in busy:
            s.close()


def test_a_taken_port_stops_the_gateway_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pergola.cli", "gateway", "--triton", "127.0.0.1:1",
                              "--gateway-bind", "127.0.0.1", "--gateway-port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and time.monotonic() - started < 30
    assert f"port {port} is in use" in run.stderr and "--gateway-port" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_a_taken_port_stops_serve_before_triton_starts(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "pergola.cli", "serve", "--repo", str(tmp_path / "repo"),
                              "--device", "cpu", "--gateway-bind", "127.0.0.1", "--gateway-port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode != 0, run.stdout + run.stderr
    assert f"pergola serve: port {port} is in use" in run.stderr and "--gateway-port" in run.stderr, run.stderr
    assert "tritonserver" not in run.stdout, run.stdout


@pytest.mark.server
def test_serve_stops_when_its_gateway_cannot_bind_after_all(tmp_path: Path, minilm_folder: Path):
    """The port is free when `serve` checks it and taken when the gateway child binds: `serve`
    sees its child end, stops tritonserver and exits non-zero within 30 s."""
    from conftest import start_serve

    taker = socket.socket()
    taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taker.bind(("127.0.0.1", 0))  # (bound, not listening: serve's own check binds beside it)
    port = taker.getsockname()[1]
    served = start_serve(tmp_path, str(minilm_folder), "--gateway-port", str(port), wait=False)
    served.gateway = port
    try:
        deadline = time.monotonic() + 120
        while "gateway: http://" not in served.log.read_text(errors="replace"):
            assert served.proc.poll() is None and time.monotonic() < deadline, served.log_tail()
            time.sleep(0.05)
        taker.listen()  # before the child's interpreter has started
        taken = time.monotonic()
        code = served.proc.wait(timeout=60)
        took = time.monotonic() - taken
    finally:
        served.stop()
        taker.close()
    log = served.log_tail()
    assert code != 0 and took < 30, (code, took, log)
    assert f"port {port} is in use" in log and "the gateway exited" in log, log
    # stopped during start-up, it leaves no Python-backend stub behind (one still initialising
    # its model is not told to stop by tritonserver)
    assert not live_stubs(served.repo), live_stubs(served.repo)
