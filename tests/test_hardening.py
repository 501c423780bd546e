"""`pergola serve` as a careless or hostile client meets it: closed admin doors, recovery from
dead stubs every time (the model alone) and from crashes of tritonserver itself (the server), a
clean shutdown, one server per repository folder."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import fuzz_server
import numpy as np
import pytest
from conftest import TEXTS, ServeProcess, cosine_rows, describe_processes, running, start_serve

EVIL_MODEL = """
import pathlib
class TritonPythonModel:
    def initialize(self, args):
        pathlib.Path({marker!r}).write_text("ran")
    def execute(self, requests):
        return []
"""
EVIL_CONFIG = {"name": "x", "backend": "python", "max_batch_size": 0,
               "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [1]}],
               "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]}]}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path):
    # a low memory bound: the request that makes Triton fill memory is caught within seconds on any host
    served = start_serve(tmp_path_factory.mktemp("serve"), f"mini={minilm_folder}", "--server-memory-gb", "4")
    yield served
    served.stop()


def http_call(served: ServeProcess, method: str, path: str, body: dict | None = None,
              token: str | None = None) -> tuple[int, str]:
    headers = {"pergola-admin-token": token} if token else {}
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(f"http://127.0.0.1:{served.http}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def token_of(served: ServeProcess) -> str:
    path = served.repo / ".admin-token"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    return path.read_text().strip()


def evil_load_body(marker: Path) -> dict:
    source = EVIL_MODEL.format(marker=str(marker)).encode()
    return {"parameters": {"config": json.dumps(EVIL_CONFIG), "file:1/model.py": base64.b64encode(source).decode()}}


ANONYMOUS_HTTP = [
    ("POST", "/v2/repository/index", None),
    ("POST", "/v2/repository/models/embed/unload", None),
    ("POST", "/v2/repository/models/mini_encoder/load", None),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/region/r/register", {"key": "/pergola_x", "offset": 0, "byte_size": 64}),
]


@pytest.mark.parametrize("method,path,body", ANONYMOUS_HTTP)
@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_admin_http_apis_refuse_calls_without_the_token(served, method, path, body, token):
    status, text = http_call(served, method, path, body, token=token)
    assert status >= 400 and "restricted" in text, (status, text)
    assert http_call(served, "GET", "/v2/models/embed/ready")[0] == 200
    assert http_call(served, "GET", "/v2/health/ready")[0] == 200


def test_anonymous_model_upload_runs_no_code(served, tmp_path):
    marker = tmp_path / "ran"
    status, text = http_call(served, "POST", "/v2/repository/models/x/load", evil_load_body(marker))
    assert status >= 400 and "restricted" in text, (status, text)
    time.sleep(0.5)  # (a load runs initialize before it answers: test_the_admin_token_opens_the_repository_api)
    assert not marker.exists()
    assert "x" not in {row["name"] for row in json.loads(
        http_call(served, "POST", "/v2/repository/index", token=token_of(served))[1])}


def test_admin_grpc_apis_refuse_calls_without_the_token(served, tmp_path):
    import tritonclient.grpc as grpcclient
    from pergola.triton.admin import GRPC_ADMIN_HEADER
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc}")
    marker = tmp_path / "ran"
    body = evil_load_body(marker)["parameters"]
    calls = {
        "index": lambda h: client.get_model_repository_index(headers=h),
        "load": lambda h: client.load_model("x", headers=h, config=body["config"],
                                            files={"file:1/model.py": base64.b64decode(body["file:1/model.py"])}),
        "unload": lambda h: client.unload_model("embed", headers=h),
        "log settings": lambda h: client.update_log_settings({"log_verbose_level": 1}, headers=h),
        "trace settings": lambda h: client.get_trace_settings(headers=h),
        "shared memory": lambda h: client.register_system_shared_memory("r", "/pergola_x", 64, headers=h),
    }
    for name, call in calls.items():
        for headers in (None, {GRPC_ADMIN_HEADER: "wrong-token-0123456789"}):
            with pytest.raises(InferenceServerException, match="restricted") as err:
                call(headers)
            assert err.value, name
    time.sleep(0.5)  # (as above: a load that ran would have written the marker before it answered)
    assert not marker.exists()
    assert client.is_model_ready("embed") and client.is_server_ready()
    # The token opens the same doors: the repository index answers over gRPC too.
    index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: token_of(served)}, as_json=True)
    assert {"embed", "mini_encoder"} <= {m["name"] for m in index["models"]}


def test_the_admin_token_opens_the_repository_api(served, tmp_path):
    """An operator with the token can load an uploaded model (the door is closed, not walled up)."""
    marker = tmp_path / "ran"
    token = token_of(served)
    status, text = http_call(served, "POST", "/v2/repository/models/x/load", evil_load_body(marker), token=token)
    assert status == 200, text
    assert marker.read_text() == "ran"
    assert http_call(served, "POST", "/v2/repository/models/x/unload", token=token)[0] == 200
    # The unload finishes in the background (the uploaded model leaves the index at once); strict
    # readiness is false until its stub has gone, ~1.5 s here.
    deadline = time.monotonic() + 60
    while not ready(served) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ready(served), served.log_tail()


def test_inference_and_health_stay_open(served, reference):
    from pergola_client import PergolaClient

    with PergolaClient(f"127.0.0.1:{served.grpc}") as client:
        out = client.embed(TEXTS[:2])
    assert cosine_rows(out, reference[:2]).min() >= 0.9999
    assert http_call(served, "GET", "/v2/health/live")[0] == 200
    assert http_call(served, "GET", "/v2/models/embed/config")[0] == 200


def test_a_second_server_on_the_same_repository_is_refused(served):
    from pergola.triton.server import free_ports

    http, grpc, metrics = free_ports(3)
    out = subprocess.run(
        [sys.executable, "-m", "pergola.cli", "serve", "--repo", str(served.repo), "--device", "cpu",
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "in use by another pergola server" in out.stderr + out.stdout
    assert (served.repo / "mini_encoder" / "config.pbtxt").is_file()  # not rewritten under the first
    assert http_call(served, "GET", "/v2/health/ready")[0] == 200


def ready(served: ServeProcess) -> bool:
    try:
        return http_call(served, "GET", "/v2/health/ready")[0] == 200 and \
            http_call(served, "GET", "/v2/models/embed/ready")[0] == 200
    except OSError:  # connection refused while the server restarts
        return False


def test_recovery_every_time_a_stub_dies_under_traffic(served, reference):
    """Two kills of the encoder's stub in a row under steady traffic: each time the model is
    loaded again on its own (the server is not restarted), it answers again within 15 s, and no
    answer is ever wrong (tests/test_fault_locality.py: the other models meanwhile)."""
    from pergola.triton.supervisor import stub_pids
    from pergola_client import PergolaClient

    answers: list[tuple[float, object]] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                with PergolaClient(f"127.0.0.1:{served.grpc}", timeout_s=10) as client:
                    answers.append((time.monotonic(), client.embed(TEXTS[:2])))
            except Exception as e:  # noqa: BLE001 - failures while a stub is down are expected
                answers.append((time.monotonic(), e))
                time.sleep(0.1)
            time.sleep(0.05)

    server = tritonserver_pid(served.repo)
    thread = threading.Thread(target=traffic, daemon=True)
    thread.start()
    recoveries = []
    try:
        for _ in range(2):  # the second recovery shows it is every time, not only the first
            [stub] = stub_pids(served.repo)["mini_encoder"]
            killed_at = time.monotonic()
            os.kill(stub, signal.SIGKILL)
            while time.monotonic() - killed_at < 60:
                failed = [t for t, a in answers if t > killed_at and not isinstance(a, np.ndarray)]
                ok = [t for t, a in answers if t > max(failed, default=killed_at) and isinstance(a, np.ndarray)]
                if failed and ok:
                    recoveries.append(ok[0] - killed_at)
                    break
                time.sleep(0.2)
            assert len(recoveries) == _ + 1, served.log_tail()
            assert stub_pids(served.repo)["mini_encoder"] != [stub]
            steady = time.monotonic() + 30  # steady service (a few correct answers) before the next kill
            while sum(isinstance(a, np.ndarray) for t, a in answers if t > killed_at) < 6 and time.monotonic() < steady:
                time.sleep(0.2)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert served.proc.poll() is None
    assert tritonserver_pid(served.repo) == server, "the whole server was restarted"
    print(f"recovered after {', '.join(f'{r:.1f}' for r in recoveries)} s")
    assert max(recoveries) <= 15.0, recoveries
    good = [a for _, a in answers if isinstance(a, np.ndarray)]
    assert len(good) > 10
    for out in good:
        assert cosine_rows(out, reference[:2]).min() >= 0.9999


def tritonserver_pid(repo: Path) -> int:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"tritonserver") and f"--model-repository={repo}".encode() in args:
            return int(cmdline.parent.name)
    raise AssertionError("no tritonserver serves this repository")


def wait_for_service(served: ServeProcess, reference: np.ndarray, since: float, timeout: float = 60) -> float:
    """Seconds from `since` until a correct answer comes back (readiness must go false first)."""
    from pergola_client import PergolaClient

    saw_not_ready = False
    while time.monotonic() - since < timeout:
        saw_not_ready |= not ready(served)
        if saw_not_ready:
            try:
                with PergolaClient(f"127.0.0.1:{served.grpc}", timeout_s=10) as client:
                    out = client.embed(TEXTS[:2])
                assert cosine_rows(out, reference[:2]).min() >= 0.9999
                return time.monotonic() - since
            except Exception:  # noqa: BLE001 - still restarting
                pass
        time.sleep(0.2)
    try:
        server = describe_processes([tritonserver_pid(served.repo)])
    except AssertionError as e:
        server = str(e)
    raise AssertionError(f"not recovered (saw not-ready: {saw_not_ready}); {server}\n{served.log_tail()}")


def test_recovery_when_tritonserver_itself_crashes(served, reference):
    """The server process dying (OOM killer, a crash) is recovered like a dead stub."""
    pid = tritonserver_pid(served.repo)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    took = wait_for_service(served, reference, killed_at)
    assert tritonserver_pid(served.repo) != pid
    assert took <= 15.0, took


@pytest.mark.parametrize("case", sorted(fuzz_server.TRITON_CRASHES))
def test_recovery_after_a_request_that_crashes_triton(served, reference, case):
    """Single anonymous HTTP requests that end Triton 2.51's process (a JSON body over ~4 MiB,
    Triton issue #5840; a JSON numeric input claiming 2^40 elements, which Triton tries to
    allocate): they used to take the server down for good. The supervisor sees the fatal signal
    in Triton's output (its crash handler may hang instead of exiting) and restarts it."""
    path, body = fuzz_server.TRITON_CRASHES[case]
    sent_at = time.monotonic()
    try:
        status, _ = http_call(served, "POST", path.format(name="mini"), json.loads(body))
        assert status == 400  # a fixed Triton refuses it
    except OSError:  # the connection dropped: the server crashed
        took = wait_for_service(served, reference, sent_at)
        assert took <= 20.0, took
    assert ready(served)


def test_a_server_whose_memory_runs_away_is_restarted(tmp_path, monkeypatch):
    """Where the host overcommits, Triton 2.51 keeps filling what a request's shape claims (113 GB
    a minute after a 2^40-element JSON input on the H100 host, where the CPU host aborts at once):
    the supervisor's memory limit turns that into a restart. A process that grows past the limit
    is reported; one under it is watched until it ends."""
    import pergola.triton.server
    from pergola.triton.server import server_memory_limit
    from pergola.triton.supervisor import Supervisor

    class Live:  # the server answers /v2/health/live: only the memory can end the watch
        def live(self) -> bool:
            return True

    def holding(size: int, seconds: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"import time; b = bytearray({size}); time.sleep({seconds})"])

    assert server_memory_limit(-1) == 0 and server_memory_limit(0.5) == 1 << 29
    assert 0 < server_memory_limit(0) < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = tmp_path / "memory.max"  # a container's limit, when lower than the host's, is the one
    monkeypatch.setattr(pergola.triton.server, "CGROUP_LIMITS", (cgroup,))
    cgroup.write_text("1073741824\n")
    assert server_memory_limit(0) == 1 << 29
    cgroup.write_text("max\n")
    assert server_memory_limit(0) == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    supervisor = Supervisor(tmp_path, Live(), interval_s=0.1, memory_limit_bytes=200 << 20)
    big, small = holding(400 << 20, 30), holding(1 << 20, 2)
    try:
        reason = supervisor.watch(lambda: big.poll() is None, pid=big.pid)
        assert reason is not None and "over its 0.2 GB limit (--server-memory-gb" in reason
        assert supervisor.watch(lambda: small.poll() is None, pid=small.pid) is None
    finally:
        big.kill(), small.kill(), big.wait(), small.wait()


PYTHON_MODELS = str(Path(__file__).resolve().parents[1] / "python_models")


def kill_and_expect_gone(parent: subprocess.Popen, child: int, within_s: float = 10.0) -> None:
    """SIGKILL `parent`, reap it (as whoever started tritonserver does), then `child` must end."""
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + within_s
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child), describe_processes([child])


def test_processes_start_cleanly_from_a_process_that_uses_grpc():
    """tritonserver, and the gateway, are started from processes where gRPC runs (tests and
    benchmarks with tritonclient, `pergola serve`'s gateway). A child started with preexec_fn
    crashed before exec in 9 of 300 starts here (gRPC's fork handlers; once it was a test's
    tritonserver, "epoll_wait error: Bad file descriptor"); popen_tied must start all of them."""
    code = f"""
import subprocess, sys
from concurrent import futures
import grpc
sys.path.insert(0, {PYTHON_MODELS!r})
from pergola.triton.server import popen_tied
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{{port}}")
grpc.channel_ready_future(channel).result(timeout=10)
def start(_):
    return popen_tied(["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
with futures.ThreadPoolExecutor(4) as pool:  # 4 at a time (with preexec_fn as many failed, 31 of 300)
    codes = list(pool.map(start, range(300)))
print(sum(c != 0 for c in codes), sorted(set(codes)))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[0] == "0", f"children that failed, exit codes: {run.stdout}"


def test_a_tied_process_ends_with_the_process_that_started_it():
    """popen_tied's child gets SIGTERM when its parent dies (a killed `pergola serve` or test run
    must leave no tritonserver holding ports and a GPU)."""
    code = (f"import sys; sys.path.insert(0, {PYTHON_MODELS!r}); import time; from pergola.triton.server import popen_tied; "
            "print(popen_tied(['sleep', '120']).pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # the wrapper has asked for the signal and become `sleep`
        with open(f"/proc/{child}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"sleep"
        kill_and_expect_gone(parent, child)
    finally:
        parent.kill()
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)


def test_a_stub_that_holds_its_gil_for_good_still_ends_with_its_server():
    """A stand-in stub (a child of a stand-in server) calls end_with_server and then blocks
    holding the GIL, as one waiting inside a python_backend metric call on a dead server does:
    the watch thread alone never runs again; the watchdog process ends the stub anyway."""
    stub = ("import ctypes, sys; sys.path.insert(0, %r); from pergola.triton.adapter import end_with_server; "
            "end_with_server(); print('ready', flush=True); ctypes.PyDLL(None).sleep(120)")
    server = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', %r]); "
              "print(p.pid, flush=True); time.sleep(120)")
    code = server % (stub % str(Path(__file__).resolve().parents[1] / "python_models"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ready"
        kill_and_expect_gone(parent, child)
    finally:
        parent.kill()
        subprocess.run(["pkill", "-9", "-f", "pergola-stub-watchdog " + str(parent.pid)], check=False)
        if child is not None and running(child):
            os.kill(child, signal.SIGKILL)


def test_shutdown_is_clean_and_quick(served):
    """SIGTERM (what `make serve`'s Ctrl-C and `docker stop` send) after the kills above: exit
    code 0 within a few seconds, no restart after the signal, no shared memory left behind."""
    pid = served.proc.pid
    started = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    code = served.proc.wait(timeout=60)
    took = time.monotonic() - started
    log = served.log.read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert took < 10.0, (took, log[-3000:])
    assert "restarting tritonserver" not in log[log.rindex("Signal (15) received"):]
    assert not list(Path("/dev/shm").glob(f"pergola_{pid}_*"))
