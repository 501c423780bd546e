"""The server's closed doors: the admin token and the repository API calls that need it.

Triton's model-repository API (load / unload with uploaded files), logging, trace and
shared-memory APIs can change what the server runs; Triton's secure-deployment guide says to
restrict them. `pergola serve` starts tritonserver with `--http-restricted-api` and
`--grpc-restricted-protocol` for exactly those, keyed on the HTTP header ADMIN_HEADER (gRPC
metadata GRPC_ADMIN_HEADER): a call without the token is refused ("This API is restricted, expecting header ..."), inference and
health stay open. The token is generated at start into a 0600 file in the repository folder
(or read from `--admin-token-file`); `pergola add-version` and the stub supervisor send it.
Triton 2.51 takes these keys only on its command line, which every user of the host can read:
the API keys of `--api-key` therefore never go to tritonserver (the gateway checks them, and
Triton's ports stay on loopback behind it: cli.serve), and the admin token is one random
value per start unless `--admin-token-file` gives one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import urllib.error
import urllib.request
from pathlib import Path

ADMIN_HEADER = "pergola-admin-token"
# Triton's gRPC frontend expects restricted-protocol keys with this prefix in the call metadata.
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
RESTRICTED_APIS = ("model-repository", "logging", "trace", "shared-memory")
# A key the gateway sends to Triton's inference (header, gRPC metadata with Triton's prefix); Triton
# asks for none since `pergola serve` keeps API keys off its command line (module docstring).
API_KEY_HEADER = "pergola-api-key"
GRPC_API_KEY_HEADER = f"triton-grpc-protocol-{API_KEY_HEADER}"
TOKEN_FILE_NAME = ".admin-token"
# A config parameter that a recovery load sets to a new value: the changed config makes Triton load
# a fresh copy of the model (a load that changes nothing is a no-op; pergola/triton/supervisor.py).
RECOVERY_PARAMETER = "pergola_recovery"
# Triton parses `APIS:KEY=VALUE`; a token holds none of ':', '=', ',' or whitespace.
_TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/-]{16,256}")


class AdminError(RuntimeError):
    pass


def default_token_file(repo: str | Path) -> Path:
    return Path(repo).expanduser().resolve() / TOKEN_FILE_NAME


def check_token(token: str, source: str, what: str = "the admin token") -> str:
    if not _TOKEN_RE.fullmatch(token):
        raise AdminError(f"{what} in {source} must be 16-256 characters of A-Z a-z 0-9 . _ ~ + / - "
                         "(no spaces, ':', '=' or ','); generate one with `python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'`")
    return token


def read_token(path: str | Path) -> str:
    path = Path(path).expanduser()
    try:
        return check_token(path.read_text().strip(), str(path))
    except FileNotFoundError:
        raise AdminError(f"no admin token file at {path}: is a `pergola serve` running with this --repo? "
                         "(or pass --admin-token-file)") from None


def write_token(path: str | Path, token: str | None = None) -> str:
    """Write `token` (default: a new random one) to `path`, readable by its owner only."""
    token = check_token(token or secrets.token_urlsafe(32), "the generated token")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token + "\n")
    return token


def restricted_api_flags(token: str) -> list[str]:
    """tritonserver flags that put RESTRICTED_APIS behind the token on both protocols."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={token}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={token}"]


def redact(cmd: list[str], *secrets: str | None) -> list[str]:
    """The command line with the token and keys replaced, for logs."""
    for secret in filter(None, secrets):
        cmd = [arg.replace(secret, "***") for arg in cmd]
    return cmd


class RepositoryClient:
    """Triton's model-repository API over HTTP, with the admin token."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
        self.token = token

    def _post(self, path: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body or {}).encode(), method="POST",
                                     headers={ADMIN_HEADER: self.token, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            raise AdminError(f"POST {path}: HTTP {e.code}: {detail}") from None

    def index(self, timeout: float = 30.0) -> dict[str, str]:
        """Model name -> state: READY if any version is ready, else LOADING / UNLOADING if one
        is on its way, else what the repository says (UNAVAILABLE, ...)."""
        rank = {"READY": 0, "LOADING": 1, "UNLOADING": 2}
        states: dict[str, str] = {}
        for row in json.loads(self._post("/v2/repository/index", timeout=timeout)):
            state, name = row.get("state", ""), row["name"]
            if name not in states or rank.get(state, 9) < rank.get(states[name], 9):
                states[name] = state
        return states

    def live(self, timeout: float = 2.0) -> bool:
        """Does the server answer /v2/health/live (open to all) within `timeout` seconds?"""
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/live", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def load(self, name: str) -> None:
        self._post(f"/v2/repository/models/{name}/load")

    def unload(self, name: str) -> None:
        self._post(f"/v2/repository/models/{name}/unload", timeout=60)


class ModelLoader:
    """Triton's repository load over gRPC, with the admin token (pergola/triton/supervisor.py: a load
    over HTTP held the inference requests of other models that shared its Triton HTTP thread)."""

    def __init__(self, address: str, token: str) -> None:
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(address)
        self.headers = {GRPC_ADMIN_HEADER: token}

    def reload(self, name: str, mark: str, timeout_s: float) -> None:
        """Load `name` again from its files, with the config it runs and RECOVERY_PARAMETER =
        `mark` (a value it never had); returns once the fresh copy serves, raises AdminError."""
        from tritonclient.utils import InferenceServerException

        try:
            config = self.client.get_model_config(name, as_json=True, client_timeout=30)["config"]
            config.setdefault("parameters", {})[RECOVERY_PARAMETER] = {"string_value": mark}
            self.client.load_model(name, headers=self.headers, config=json.dumps(config), client_timeout=timeout_s)
        except InferenceServerException as e:
            raise AdminError(f"loading {name}: {e.message()}") from None

    def close(self) -> None:
        self.client.close()
