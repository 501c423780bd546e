"""Run the real `tritonserver` 2.51 that the `nvidia-pytriton` wheel ships, without Docker.

The wheel holds `tritonserver/bin/tritonserver`, the Python backend and one stub per Python
version. We assemble a backend folder (backend library + the stub for *this* interpreter) in a
cache, then start the server with this environment's `bin/` first on PATH: the stub runs the
first `python3` it finds, whose numpy must be 1.x (the stub reads tensors wrongly under 2.x).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("PERGOLA_CACHE", Path.home() / ".cache" / "pergola"))


class ServerError(RuntimeError):
    pass


def _pytriton_root() -> Path:
    """The `pytriton` folder that holds `tritonserver/` (its parent holds `nvidia_pytriton.libs`).

    PERGOLA_TRITON_ROOT, when set, names the unpacked `tritonserver` folder directly (offline GPU
    hosts: scripts/gpu_setup.sh), so the `pytriton` package and its dependencies need not import.
    """
    override = os.environ.get("PERGOLA_TRITON_ROOT")
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
    def prepare(cls, cache: Path = DEFAULT_CACHE) -> "TritonInstall":
        """Locate the wheel's server; assemble backends/python with this Python's stub (idempotent)."""
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
        backend_dir = cache / "triton-backends"
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
        stub_bin = os.environ.get("PERGOLA_STUB_BIN") or str(Path(sys.executable).parent)
        env["PATH"] = f"{stub_bin}:{env.get('PATH', '')}"
        return env


@dataclass
class ServerOptions:
    repo: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    model_control: str = "none"  # "none" loads everything; "explicit" for the repository API
    log_verbose: int = 0
    shm_bytes: int = 8 << 20  # Python backend shared-memory arena per instance (grows by as much)
    extra: list[str] = field(default_factory=list)


def server_command(install: TritonInstall, opts: ServerOptions) -> list[str]:
    return [
        str(install.binary),
        f"--model-repository={opts.repo}",
        f"--backend-directory={install.backend_dir}",
        f"--http-port={opts.http_port}",
        f"--grpc-port={opts.grpc_port}",
        f"--metrics-port={opts.metrics_port}",
        f"--model-control-mode={opts.model_control}",
        f"--log-verbose={opts.log_verbose}",
        f"--backend-config=python,shm-default-byte-size={opts.shm_bytes}",
        f"--backend-config=python,shm-growth-byte-size={opts.shm_bytes}",
        "--strict-readiness=true",
        *(["--load-model=*"] if opts.model_control == "explicit" else []),
        *opts.extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(http_port: int, process: subprocess.Popen | None, timeout: float = 180.0) -> None:
    """Poll /v2/health/ready until the server and every model are up."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise ServerError(f"tritonserver was not ready after {timeout:.0f} s")


def start(opts: ServerOptions, log_path: Path | None = None) -> subprocess.Popen:
    """Start tritonserver in the background (tests, benchmarks)."""
    install = TritonInstall.prepare()
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen(server_command(install, opts), env=install.env(), stdout=out, stderr=subprocess.STDOUT)


def serve_supervised(opts: ServerOptions) -> int:
    """Run tritonserver in the foreground with the stub supervisor beside it (`make serve`).

    Explicit model control lets the supervisor reload a model whose Python stub died; SIGINT and
    SIGTERM go to tritonserver, whose exit code this returns.
    """
    import signal
    import threading

    from pergola.supervisor import supervise

    install = TritonInstall.prepare()
    cmd = server_command(install, opts)
    print("+ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=install.env())
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))

    def watch() -> None:
        try:
            wait_ready(opts.http_port, proc, timeout=600)
        except ServerError:
            return
        supervise(opts.repo, opts.http_port, alive=lambda: proc.poll() is None)

    if opts.model_control == "explicit":
        threading.Thread(target=watch, name="pergola-supervisor", daemon=True).start()
    return proc.wait()


def exec_foreground(opts: ServerOptions) -> None:
    """Replace this process with tritonserver (`make serve`): signals go straight to it."""
    install = TritonInstall.prepare()
    cmd = server_command(install, opts)
    print("+ " + " ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, install.env())
