"""The container as users run it, with podman: the README's docker lines and the compose file.

Each test starts the CPU image the way the README or deploy/docker-compose.yml says (`docker` read
as `podman`, the gateway's port published on 127.0.0.1 instead of every interface, the host's
limits on open files and processes) and checks its answers with the openai SDK against
sentence-transformers on the same weights. `make test-container` builds the image first
(scripts/container_base.sh, scripts/build_image.sh --cpu; docs/container.md) and sets
PERGOLA_CONTAINER_REQUIRED=1; without it, a host with no podman or no image skips these tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import TEXTS, cosine_rows

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
IMAGE = os.environ.get("PERGOLA_CONTAINER_IMAGE", f"localhost/pergola:{VERSION}-cpu")
REQUIRED = os.environ.get("PERGOLA_CONTAINER_REQUIRED") == "1"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
START_S = 300  # a container's start on a busy 2-core host: tritonserver, two stubs, torch imports
HOLDER = "/path/to/hf-model"  # the README's placeholder for a model folder

pytestmark = [pytest.mark.server, pytest.mark.container]


def unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(reason)
    pytest.skip(reason)


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


@pytest.fixture(scope="session")  # (session: set up before the session-wide reference vectors)
def image() -> str:
    if not shutil.which("podman"):
        unavailable("podman is not installed (make test-container installs it: scripts/container_base.sh)")
    if podman("info", check=False).returncode:
        unavailable("podman is installed but `podman info` fails (scripts/container_base.sh writes its "
                    "containers.conf)")
    if podman("image", "exists", IMAGE, check=False).returncode:
        unavailable(f"the image {IMAGE} is not built (make test-container builds it)")
    return IMAGE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_line(marker: str) -> str:
    """The README's `docker run` command (continuation lines joined) that contains `marker`."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines() if line.startswith("docker run")]
    found = [line for line in lines if marker in line]
    assert found, f"README.md has no `docker run` line with {marker!r}"
    return found[0]


def as_podman(line: str, image: str, name: str, port: int, mounts: dict[str, Path]) -> list[str]:
    """`docker run ...` as the podman command this host runs: detached and named, the host's limits,
    the gateway's port on 127.0.0.1:`port`, README placeholders replaced by `mounts`, our image."""
    words = shlex.split(line)
    assert words[:2] == ["docker", "run"], line
    out = ["podman", "run", "-d", "--name", name, "--ulimit", "host"]
    words = iter(words[2:])
    for word in words:
        if word == "-p":
            published = next(words)
            assert published == "8080:8080", f"only the gateway's port is published: {line}"
            out += ["-p", f"127.0.0.1:{port}:8080"]
        elif word == "-v":
            host, inside = next(words).split(":", 1)
            out += ["-v", f"{mounts.get(host, host)}:{inside}"]
        elif re.fullmatch(r"pergola:[\w.-]+", word):
            out.append(image)
        else:
            out.append(word)
    return out


class Container:
    """A started container: its gateway on 127.0.0.1:`port`."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port

    def logs(self) -> str:
        done = podman("logs", self.name, check=False)
        return (done.stdout + done.stderr)[-4000:]

    def running(self) -> bool:
        return podman("inspect", "-f", "{{.State.Running}}", self.name, check=False).stdout.strip() == "true"

    def exec(self, *args: str, timeout: float = 300) -> str:
        done = podman("exec", self.name, *args, timeout=timeout, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def triton(self, path: str) -> dict:
        """GET Triton's HTTP API from inside the container (its ports are on the container's loopback)."""
        return json.loads(self.exec("python3", "-c", "import sys, urllib.request as u; "
                                    f"sys.stdout.write(u.urlopen('http://127.0.0.1:8000{path}').read().decode())"))

    def wait_ready(self, timeout: float = START_S) -> None:
        wait_healthy(self.port, timeout, alive=self.running, logs=self.logs)

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=120)


def wait_healthy(port: int, timeout: float, alive, logs) -> None:
    """Until the gateway's /health answers 200 (a Triton replica ready with its models)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
                return
        except (urllib.error.URLError, ConnectionError):
            assert alive(), f"the container stopped:\n{logs()}"
            assert time.monotonic() < deadline, f"not ready in {timeout:.0f} s:\n{logs()}"
            time.sleep(1)


@contextmanager
def started(command: list[str], name: str, port: int) -> Iterator[Container]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    container = Container(name, port)
    try:
        assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout}{done.stderr}"
        yield container
    finally:
        podman("rm", "-f", "-t", "10", name, check=False)


def embed(client, model: str, texts: list[str]) -> np.ndarray:
    out = client.embeddings.create(model=model, input=texts)
    return np.array([d.embedding for d in out.data], dtype=np.float32)


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


# --- the README's docker lines ---------------------------------------------------------------

def test_the_readme_cpu_line_serves_minilm_to_the_openai_sdk(image, reference):
    name, port = f"pergola-test-cpu-{os.getpid()}", free_port()
    with started(as_podman(readme_line(f"pergola:{VERSION}-cpu"), image, name, port, {}), name, port) as c:
        c.wait_ready()
        client = c.openai()
        assert {"embed", "all-MiniLM-L6-v2"} <= {m.id for m in client.models.list().data}
        for model in ("all-MiniLM-L6-v2", "embed"):
            assert cosine_rows(embed(client, model, TEXTS), reference).min() >= 0.9999
        # Triton's ports are on the container's loopback: from its network, only the gateway answers.
        address = podman("inspect", "-f", "{{.NetworkSettings.IPAddress}}", name).stdout.strip()
        assert port_open(address, 8080) and not any(port_open(address, p) for p in (8000, 8001, 8002))
        assert c.triton("/v2/models/all-MiniLM-L6-v2_encoder")["versions"] == ["1"]  # (inside, it answers)


def model_copy(src: Path, dst: Path, pooling: dict) -> Path:
    """A real copy of a model folder (a mount cannot follow symlinks to the host) with other pooling."""
    shutil.copytree(src, dst)
    config = dst / "1_Pooling" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | pooling))
    return dst


@pytest.fixture(scope="module")
def mounted(image, minilm_folder, tmp_path_factory):
    """The README's GPU line (`--gpus all`: accepted and ignored here) with our image: the MiniLM
    folder at /models/default, and two more mounts, the state folder (the repository) and v2."""
    root = tmp_path_factory.mktemp("container")
    state, v2 = root / "state", root / "v2"
    state.mkdir()
    model_copy(minilm_folder, v2, {"pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True})
    name, port = f"pergola-test-mounted-{os.getpid()}", free_port()
    command = as_podman(readme_line(f"{HOLDER}:/models/default:ro"), image, name, port, {HOLDER: minilm_folder})
    command[-1:-1] = ["-v", f"{state}:/var/lib/pergola", "-v", f"{v2}:/models/v2:ro"]
    with started(command, name, port) as c:
        c.wait_ready()
        yield c, state, v2


def test_the_readme_gpu_line_serves_a_mounted_model_folder(mounted, reference):
    c, state, _ = mounted
    assert cosine_rows(embed(c.openai(), "default", TEXTS), reference).min() >= 0.9999
    assert (state / "repository" / "default_encoder" / "1" / "model.py").is_file()  # written where mounted


def test_a_version_swapped_through_the_mounted_repository(mounted, reference):
    """`pergola add-version` inside the container writes version 2 into the mounted repository and
    loads it: the served vectors become v2's (CLS pooling instead of mean)."""
    from sentence_transformers import SentenceTransformer

    c, state, v2 = mounted
    c.exec("pergola", "add-version", "--name", "default", "--model", "/models/v2", "--url", "http://127.0.0.1:8000")
    assert (state / "repository" / "default_encoder" / "2").is_dir()
    assert c.triton("/v2/models/default_encoder")["versions"] == ["2"]
    expected = SentenceTransformer(str(v2), device="cpu").encode(TEXTS)
    got = embed(c.openai(), "default", TEXTS)
    assert cosine_rows(got, expected).min() >= 0.9999
    assert cosine_rows(got, reference).min() < 0.99  # not version 1's answer any more


# --- the compose file ------------------------------------------------------------------------

def test_the_compose_file_serves_through_its_gateway_over_both_replicas(image, minilm_folder, reference):
    """deploy/docker-compose.yml with podman-compose (Debian's package): two Triton replicas and
    the gateway, all from our image; a request of 64 texts is cut into two chunks, one a replica."""
    if not shutil.which("podman-compose"):
        unavailable("podman-compose is not installed (scripts/container_base.sh installs it)")
    project, port = f"pergola-test-{os.getpid()}", free_port()
    env = os.environ | {"PERGOLA_IMAGE": image, "PERGOLA_MODEL_DIR": str(minilm_folder),
                        "PERGOLA_PUBLISH": f"127.0.0.1:{port}"}

    def compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["podman-compose", "-p", project, "-f", str(COMPOSE), *args], env=env,
                              capture_output=True, text=True, timeout=300)

    replicas = [f"{project}_pergola-{i}_1" for i in (0, 1)]
    gateway = Container(f"{project}_gateway_1", port)
    try:
        up = compose("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout + up.stderr
        gateway.wait_ready()
        for replica in replicas:  # both ready: the gateway needs only one for /health
            Container(replica, 0).exec("python3", "-c", "import time, urllib.request as u\n"
                                       f"for _ in range({START_S}):\n"
                                       "    try: u.urlopen('http://127.0.0.1:8000/v2/health/ready'); break\n"
                                       "    except OSError: time.sleep(1)\n"
                                       "else: raise SystemExit('not ready')", timeout=START_S + 30)
        client = gateway.openai()
        assert cosine_rows(embed(client, "default", TEXTS), reference).min() >= 0.9999
        texts = [f"text number {i}" for i in range(64)]
        assert embed(client, "default", texts).shape == (64, 384)
        for replica in replicas:
            stats = Container(replica, 0).triton("/v2/models/default_encoder/stats")["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] >= 1, replica
    finally:
        down = compose("down", "-t", "10")
        podman("network", "rm", "-f", f"{project}_default", check=False)
        print(down.stdout[-2000:], down.stderr[-2000:])
