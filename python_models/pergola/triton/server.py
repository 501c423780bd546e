"""Run the real `tritonserver` 2.51 that the `nvidia-pytriton` wheel ships, without Docker.

The wheel holds `tritonserver/bin/tritonserver`, the Python backend and one stub per Python
version. We assemble a backend folder (backend library + the stub for *this* interpreter) in a
cache, then start the server with this environment's `bin/` first on PATH: the stub runs the
first `python3` it finds, whose numpy must be 1.x (the stub reads tensors wrongly under 2.x).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pergola.config.options import option
from pergola.config.settings import cache_dir, settings
from pergola.triton.admin import redact, restricted_api_flags


class ServerError(RuntimeError):
    pass


def _pytriton_root() -> Path:
    """The `pytriton` folder that holds `tritonserver/` (its parent holds `nvidia_pytriton.libs`).

    PERGOLA_TRITON_ROOT, when set, names the unpacked `tritonserver` folder directly (offline GPU
    hosts: scripts/gpu_setup.sh), so the `pytriton` package and its dependencies need not import.
    """
    override = settings().triton_root
    if override:
        server = Path(override).resolve()
        if not (server / "bin" / "tritonserver").is_file():
            raise ServerError(f"PERGOLA_TRITON_ROOT={override} holds no bin/tritonserver")
        return server.parent
    try:
        import pytriton
    except ImportError:
        raise ServerError("nvidia-pytriton is not installed: `pip install nvidia-pytriton==0.7.0`") from None
    return Path(pytriton.__file__).resolve().parent


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Path
    lib_dirs: list[Path]

    @classmethod
    def prepare(cls, cache: Path | None = None) -> TritonInstall:
        """Locate the wheel's server; assemble backends/python with this Python's stub (idempotent)
        in `cache` (default: cache_dir())."""
        root = _pytriton_root()
        server = root / "tritonserver"
        binary = server / "bin" / "tritonserver"
        if (server / "backends" / "python" / "triton_python_backend_stub").is_file():
            # A complete install (the NGC image's /opt/tritonserver): use its backends as they are.
            return cls(binary=binary, backend_dir=server / "backends", lib_dirs=[])
        pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = server / "python_backend_stubs" / pyver / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerError(f"nvidia-pytriton ships no Python backend stub for Python {pyver}")
        backend_dir = (cache or cache_dir()) / "triton-backends"
        python_dir = backend_dir / "python"
        marker = python_dir / ".source"
        if not marker.is_file() or marker.read_text() != str(stub):
            if python_dir.exists():
                shutil.rmtree(python_dir)
            shutil.copytree(server / "backends" / "python", python_dir)
            shutil.copy2(stub, python_dir / "triton_python_backend_stub")
            marker.write_text(str(stub))
        libs = [root.parent / "nvidia_pytriton.libs", Path(sysconfig.get_config_var("LIBDIR") or "")]
        return cls(binary=binary, backend_dir=backend_dir, lib_dirs=[p for p in libs if p.is_dir()])

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = ":".join(
            [str(p) for p in self.lib_dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
        )
        # The stub's interpreter is the first python3 on PATH: this environment's, unless
        # PERGOLA_STUB_BIN names another (a venv with numpy 1.x beside a numpy-2 torch install).
        stub_bin = settings().stub_bin or str(Path(sys.executable).parent)
        env["PATH"] = f"{stub_bin}:{env.get('PATH', '')}"
        return env


LOOPBACK = "127.0.0.1"


def is_loopback(address: str) -> bool:
    """Does `address` (an IP or a host name) listen on this host only?"""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


@dataclass
class ServerOptions:
    """How tritonserver runs; the declared options are `pergola serve` flags (pergola.config.options)."""

    repo: Path
    http_port: int = option(8000, "HTTP port (Triton's KServe v2 REST API)")
    grpc_port: int = option(8001, "gRPC port")
    metrics_port: int = option(8002, "Prometheus metrics port")
    bind: str | None = option(None, "address the HTTP, gRPC and metrics ports listen on; not set: 127.0.0.1 (this "
                                    "host only) while the gateway fronts the server, 0.0.0.0 (every interface) "
                                    "with --gateway-port 0. Triton's ports trust every caller with inference, "
                                    "and API keys never go to them (kept off its command line): with --api-key, "
                                    "an address other hosts reach is refused", metavar="ADDRESS")
    model_control: str = option("explicit", "explicit: repository API on (behind the admin token) and a stub "
                                            "supervisor that loads a model again when one of its stubs dies (the "
                                            "server again if that fails); none: load everything once, no "
                                            "recovery", choices=("explicit", "none"))
    admin_token_file: str | None = option(None, "file holding the admin token that the repository, logging, "
                                                "trace and shared-memory APIs require; not set: a new random "
                                                "token in REPO/.admin-token (mode 0600) at every start", metavar="FILE")
    log_verbose: int = option(0, "tritonserver's verbose log level (0: off)")
    otlp_endpoint: str | None = option(None, "OTLP/HTTP collector that Triton sends a trace of each request to "
                                             "(its --trace-config mode=opentelemetry); a `traceparent` header "
                                             "on the request, or on the gateway's, joins the caller's trace",
                                       metavar="http://HOST:4318/v1/traces")
    trace_rate: int = option(1, "with --otlp-endpoint: trace one request in this many")
    shm_bytes: int = option(8 << 20, "Python backend shared-memory arena per model instance, grown by as much")
    server_memory_gb: float = option(0.0, "restart tritonserver when its own resident memory passes this many GB "
                                          "(models live in their stubs, apart; responses pass through it): Triton "
                                          "2.51 allocates and fills what an HTTP request's shape claims, 113 GB in "
                                          "a minute on a host that overcommits; 0: half of this host's (or container's) memory; "
                                          "negative: no limit")
    # The repository, logging, trace and shared-memory APIs answer only calls that carry this
    # token (pergola.triton.admin); a fresh random one unless the caller has one to share.
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.otlp_endpoint and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.otlp_endpoint):
            raise ValueError(f"--otlp-endpoint must be the http(s) URL of an OTLP/HTTP collector "
                             f"(http://HOST:4318/v1/traces), got {self.otlp_endpoint!r}")
        if self.trace_rate < 1:
            raise ValueError(f"--trace-rate must be at least 1, got {self.trace_rate}")

    @property
    def address(self) -> str:
        """Where the ports listen: `bind`, loopback when it is not set (`pergola serve` sets it)."""
        return self.bind or LOOPBACK

    @property
    def local_host(self) -> str:
        """Where this machine reaches the server (the wildcard binds answer on loopback)."""
        return LOOPBACK if self.address in ("0.0.0.0", "::") else self.address


def server_command(install: TritonInstall, opts: ServerOptions) -> list[str]:
    return [
        str(install.binary),
        f"--model-repository={opts.repo}",
        f"--backend-directory={install.backend_dir}",
        f"--http-address={opts.address}",
        f"--http-port={opts.http_port}",
        f"--grpc-address={opts.address}",
        f"--grpc-port={opts.grpc_port}",
        f"--metrics-address={opts.address}",
        f"--metrics-port={opts.metrics_port}",
        f"--model-control-mode={opts.model_control}",
        f"--log-verbose={opts.log_verbose}",
        f"--backend-config=python,shm-default-byte-size={opts.shm_bytes}",
        f"--backend-config=python,shm-growth-byte-size={opts.shm_bytes}",
        "--strict-readiness=true",
        # The configs are complete (repo_builder): without this the Python backend starts one more
        # stub per model load only to complete its config, 3-9 s of imports at every start and
        # every per-model recovery on the 2-core CPU host (supervisor.py).
        "--disable-auto-complete-config",
        *restricted_api_flags(opts.admin_token),
        *(["--load-model=*"] if opts.model_control == "explicit" else []),
        *trace_flags(opts),
        *opts.extra,
    ]


def trace_flags(opts: ServerOptions) -> list[str]:
    """Triton's OpenTelemetry tracing toward --otlp-endpoint: TIMESTAMPS spans of every
    `trace_rate`-th request (queue, compute input/infer/output, per model of the ensemble)."""
    if not opts.otlp_endpoint:
        return []
    return ["--trace-config=mode=opentelemetry", f"--trace-config=opentelemetry,url={opts.otlp_endpoint}",
            "--trace-config=opentelemetry,resource=service.name=pergola", f"--trace-config=rate={opts.trace_rate}",
            "--trace-config=level=TIMESTAMPS", "--trace-config=count=-1"]


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now. Each socket stays bound until all are picked:
    picked one at a time, a port just closed can come back at once (a test's tritonserver once got
    the same port for HTTP and gRPC and refused to start)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def local_ports() -> dict[str, int]:
    """ServerOptions' http_port, grpc_port and metrics_port on three distinct free ports (tests, benchmarks)."""
    return dict(zip(("http_port", "grpc_port", "metrics_port"), free_ports(3), strict=True))


def wait_ready(http_port: int, process: subprocess.Popen | None, timeout: float = 180.0,
               host: str = "127.0.0.1", crashed: list[str] | None = None, metrics_port: int | None = None) -> None:
    """Poll /v2/health/ready until the server and every model are up, and with `metrics_port`
    its metrics too (Triton starts that service after the HTTP one: a scrape right after
    readiness can be refused); give up at once when `crashed` (see _forward_output) gets a
    line: a server hung in its crash handler neither exits nor answers."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    urls = [f"http://{host}:{http_port}/v2/health/ready"]
    if metrics_port:
        urls.append(f"http://{host}:{metrics_port}/metrics")
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        if crashed:
            raise ServerError(f"tritonserver crashed before it was seen ready ({crashed[0]})")
        try:
            with urllib.request.urlopen(urls[0], timeout=2) as r:
                if r.status == 200:
                    urls.pop(0)
                    if not urls:
                        return
                    continue
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise ServerError(f"tritonserver was not ready after {timeout:.0f} s")


# Run in a fresh interpreter (-I -S: no site, no PYTHON* variables) between Popen and the command:
# ask for SIGTERM when the parent dies, give up if it already has, then become the command.
_TIE = ("import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
        "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execv(sys.argv[2], sys.argv[3:])")


def popen_tied(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs) for a process that gets SIGTERM when this one dies (Linux),
    so a killed `pergola serve` or test run leaves no tritonserver holding its ports and GPU.

    Why a wrapper interpreter and not `preexec_fn`: preexec_fn makes CPython fork and run Python in
    the child, and with gRPC active in this process (tritonclient, the gateway) gRPC's fork
    handlers restart its poller there, which can crash the child before exec ("epoll_wait error:
    Bad file descriptor", SIGABRT or SIGSEGV): 9 of 300 starts of /bin/true from a process with a
    gRPC server and channel (grpcio 1.85), none without preexec_fn, where CPython uses vfork and
    runs no fork handlers (tests/test_hardening.py). The wrapper costs one bare interpreter start,
    little against a server start of seconds."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(cmd, **kwargs)
    path = shutil.which(cmd[0], path=(kwargs.get("env") or os.environ).get("PATH"))
    if path is None:  # as Popen would say it, in this process rather than in the wrapper
        raise FileNotFoundError(f"{cmd[0]}: not found on PATH")
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), path, *cmd], **kwargs)


def start(opts: ServerOptions, log_path: Path | None = None) -> subprocess.Popen:
    """Start tritonserver in the background (tests, benchmarks)."""
    install = TritonInstall.prepare()
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return popen_tied(server_command(install, opts), env=install.env(), stdout=out, stderr=subprocess.STDOUT)


class RepoLock:
    """One server per repository folder: an exclusive lock on `<repo>.lock` beside it.

    Two `pergola serve` on one folder would rewrite it under each other (and their
    supervisors would count each other's stubs); the second is refused instead. The lock is
    held by this process, and by tritonserver itself once it replaces this process (exec).
    """

    def __init__(self, repo: Path) -> None:
        import fcntl

        repo = Path(repo).expanduser().resolve()
        self.path = repo.with_name(repo.name + ".lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise ServerError(f"{repo} is in use by another pergola server (pid {holder}); stop it, or "
                              "give this one its own folder with --repo") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def keep_across_exec(self) -> None:
        os.set_inheritable(self._fd, True)


def _stop_now(proc: subprocess.Popen, repo: Path, grace_s: float = 1.0) -> None:
    """End a broken server: SIGTERM, SIGKILL after `grace_s` (a dead stub can hold Triton's
    shutdown for its whole exit timeout), then its remaining stubs."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _kill_stubs(repo)


def _kill_stubs(repo: Path) -> None:
    """SIGKILL the Python-backend stubs still serving `repo` once its tritonserver has gone: a stub
    still in its model's initialize() when the server stops is not told to, and waits for its
    parent for good (seen after a serve stopped during start-up)."""
    from pergola.triton.supervisor import stub_pids

    for pids in stub_pids(repo).values():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _remove_shm(prefix: str) -> None:
    """The Python backend's /dev/shm regions of a server that has exited (a killed one leaves them)."""
    for path in Path("/dev/shm").glob(f"{prefix}*"):
        path.unlink(missing_ok=True)


FATAL_SIGNAL = re.compile(rb"^Signal \((4|6|7|8|11)\) received")  # SIGILL, ABRT, BUS, FPE, SEGV
# Triton's shutdown, once no request is in flight: the model versions it still waits for
LIVE_MODELS = re.compile(rb"Found (\d+) live models and 0 in-flight non-inference requests")


@dataclass
class ServerOutput:
    """What _forward_output has read in tritonserver's output so far."""

    crashed: list[str] = field(default_factory=list)  # the fatal signal's line, once reported
    live_models: int | None = None  # while shutting down: the model versions not unloaded yet


def _forward_output(proc: subprocess.Popen) -> ServerOutput:
    """Copy tritonserver's output to ours, line by line, from a thread, noting what it reports
    (ServerOutput). Why watch the log: after "Signal (11) received" Triton's handler calls
    exit(), which can deadlock while its HTTP threads still answer /v2/health (seen with Triton
    issue #5840's crash), so the process neither exits nor looks dead."""
    out = ServerOutput()

    def pump() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            if FATAL_SIGNAL.match(line):
                out.crashed.append(line.decode(errors="replace").strip())
            elif found := LIVE_MODELS.search(line):
                out.live_models = int(found[1])

    threading.Thread(target=pump, name="tritonserver-output", daemon=True).start()
    return out


def _wait_exit(proc: subprocess.Popen, repo: Path, out: ServerOutput, orphans: int, timeout_s: float = 45.0) -> int:
    """tritonserver's exit code once it has stopped. A model copy replaced after its stub died is
    never unloaded (pergola/triton/supervisor.py), and Triton's shutdown would wait its whole exit
    timeout (30 s) for it: once no more versions are left than such copies (`orphans`; Triton's
    shutdown log counts them), the server is ended at once. Triton waits up to its exit timeout for
    in-flight requests; one that hangs longer is killed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if orphans and out.live_models is not None and out.live_models <= orphans:
            print(f"pergola: only the {out.live_models} replaced model copies are left; ending tritonserver",
                  flush=True)
            _stop_now(proc, repo, grace_s=0)
            return 0
    print(f"pergola: tritonserver did not exit within {timeout_s:.0f} s of the signal; killing it", flush=True)
    _stop_now(proc, repo, grace_s=0)
    return 1


CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def available_memory() -> int:
    """This process's memory: the host's, or its container's cgroup limit (v2, else v1) when lower
    (a pod limited to 16 GB on a 512 GB node is OOM-killed long before half of the node)."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in CGROUP_LIMITS:
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            memory = min(memory, int(value))
        break
    return memory


def server_memory_limit(gb: float) -> int:
    """--server-memory-gb in bytes: 0 is half of the memory this process may use (a bge-m3
    multi-vector answer of 64 x 8,192 tokens is 2 GB on its way out), negative is no limit (0 bytes)."""
    if gb < 0:
        return 0
    if gb == 0:
        return available_memory() // 2
    return int(gb * 2**30)


def serve_supervised(opts: ServerOptions, on_stop: Callable[[], None] | None = None) -> int:
    """Run tritonserver in the foreground: load a model again when one of its stubs dies, and
    restart the server when that fails or the server itself crashes, hangs or runs away with
    memory while serving (`make serve`; pergola/triton/supervisor.py).

    SIGINT and SIGTERM end the watch first (no restart may race the shutdown), call `on_stop`
    (`pergola serve`: the gateway's own graceful stop, which closes its connections to
    tritonserver, whose shutdown waits for them), then go to tritonserver, whose exit code this
    returns; so does a server that exits before it was ever ready (a configuration error:
    restarting would not help).
    """
    from pergola.triton.admin import ModelLoader, RepositoryClient
    from pergola.triton.supervisor import Supervisor

    install = TritonInstall.prepare()
    shm_prefix = f"pergola_{os.getpid()}_"
    cmd = server_command(install, opts) + [f"--backend-config=python,shm-region-prefix-name={shm_prefix}"]
    print("+ " + " ".join(redact(cmd, opts.admin_token)), flush=True)
    supervisor = Supervisor(opts.repo, RepositoryClient(f"{opts.local_host}:{opts.http_port}", opts.admin_token),
                            ModelLoader(f"{opts.local_host}:{opts.grpc_port}", opts.admin_token),
                            memory_limit_bytes=server_memory_limit(opts.server_memory_gb))
    stopping = False
    proc: subprocess.Popen | None = None

    def shutdown(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        print(f"pergola: {signal.Signals(signum).name} received; shutting tritonserver down", flush=True)
        if on_stop is not None:
            on_stop()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, shutdown)
    restarts = 0
    while not stopping:
        proc = popen_tied(cmd, env=install.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output = _forward_output(proc)
        crashed = output.crashed
        try:
            wait_ready(opts.http_port, proc, timeout=600, host=opts.local_host, crashed=crashed)
            reason = supervisor.watch(lambda: proc.poll() is None and not stopping and not crashed, pid=proc.pid)
        except ServerError:
            if not crashed:
                break  # exited, or never ready: its own log says why
            # crashed before the watch began: a client may send a crashing request the moment
            # the server answers ready, before this loop has seen it so
            reason = None
        if stopping:
            break
        restarts += 1
        reason = reason or (f"tritonserver crashed ({crashed[0]})" if crashed else
                            f"tritonserver exited with code {proc.returncode} while serving")
        print(f"pergola: {reason}; restarting tritonserver (restart {restarts})", flush=True)
        _stop_now(proc, opts.repo)
        _remove_shm(shm_prefix)
    rc = 0
    if proc is not None:
        rc = _wait_exit(proc, opts.repo, output, orphans=supervisor.recovered)
        _kill_stubs(opts.repo)
    _remove_shm(shm_prefix)
    return rc


def exec_foreground(opts: ServerOptions, lock: RepoLock | None = None) -> None:
    """Replace this process with tritonserver (`make serve`): signals go straight to it."""
    install = TritonInstall.prepare()
    cmd = server_command(install, opts)
    print("+ " + " ".join(redact(cmd, opts.admin_token)), flush=True)
    if lock is not None:
        lock.keep_across_exec()
    os.execve(cmd[0], cmd, install.env())
