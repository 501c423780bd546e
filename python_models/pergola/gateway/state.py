"""One gateway process's state: its options, the replicas, the served models, the keys."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from starlette.requests import Request

from pergola.gateway.admission import Admission
from pergola.gateway.backend import Backend
from pergola.gateway.catalog import ServedModel, discover
from pergola.gateway.errors import GatewayError
from pergola.gateway.http import Body, read_body
from pergola.gateway.offload import Offload
from pergola.gateway.options import GatewayOptions
from pergola.gateway.replicas import ReplicaPool, http_ports, split_target
from pergola.gateway.tokenizers import LocalTokenizers
from pergola.text.errors import quote
from pergola.triton.admin import read_token
from pergola.triton.supervisor import RECOVERING_FILE, read_recovering

log = logging.getLogger("pergola.gateway")
DEFAULT_MODELS = {"embed": "embed", "rerank": "rerank", "classify": "classify"}  # task -> served name when a request names none


def api_keys(opts: GatewayOptions) -> list[str]:
    keys = [k.strip() for k in (opts.api_key or "").split(",") if k.strip()]
    if opts.api_key_file:
        path = Path(opts.api_key_file).expanduser()
        try:
            keys += [line.strip() for line in path.read_text().splitlines() if line.strip()]
        except OSError as e:
            raise SystemExit(f"pergola gateway: cannot read --api-key-file {path}: {e.strerror}") from None
    return keys


def replica_targets(opts: GatewayOptions) -> tuple[list[str], list[int]]:
    """--triton and --triton-http-port -> (HOST:PORT per entry, its HTTP port); ValueError says
    what is wrong with either."""
    targets = [t.strip() for t in opts.triton.split(",") if t.strip()]
    for target in targets:
        split_target(target)  # (the form only: the pool resolves names itself)
    return targets, http_ports(opts.triton_http_port, targets)


class Recovering:
    """The model parts (NAME_tokenizer, NAME_encoder) that `pergola serve` is loading again after
    one of their stubs died (pergola/triton/supervisor.py writes them to RECOVERING_FILE in the repository
    it serves), read again whenever the file changes. Triton's own per-model readiness stays true
    meanwhile: Triton does not know its stub is gone."""

    def __init__(self, repository: str | None) -> None:
        self.path = Path(repository) / RECOVERING_FILE if repository else None
        self._seen: tuple[int, dict[str, dict]] = (0, {})  # (file's mtime_ns, its parts)

    def parts(self) -> dict[str, dict]:
        if self.path is None:
            return {}
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return {}
        if mtime != self._seen[0]:
            self._seen = (mtime, read_recovering(self.path.parent))
        return self._seen[1]

    def of(self, model: ServedModel) -> list[str]:
        """The parts of `model` being loaded again (none: it is ready as far as is known here)."""
        parts = self.parts()
        return [p for p in (f"{model.target}_tokenizer", f"{model.target}_encoder") if p in parts]


class Gateway:
    def __init__(self, opts: GatewayOptions) -> None:
        self.opts = opts
        self.admin_token = read_token(opts.triton_admin_token_file) if opts.triton_admin_token_file else None
        self.names = [n.strip() for n in (opts.models or "").split(",") if n.strip()]
        self.pool = ReplicaPool(*replica_targets(opts))
        keys = api_keys(opts)
        self.backend = Backend(self.pool, opts.chunk_texts, opts.chunk_chars, opts.request_timeout_s,
                               keys[0] if keys else None,
                               LocalTokenizers(opts.triton_repository, opts.gateway_tokenize_chars),
                               Admission(opts.request_timeout_s, opts.queue_bound_s), opts.chunk_window)
        self.offload = Offload(opts.gateway_cpu_workers, opts.gateway_cpu_queue)  # bulk CPU work (offload.py)
        self.offload.warm()
        self.recovering = Recovering(opts.triton_repository)
        self.started = int(time.time())
        self._models: dict[str, ServedModel] = {}
        self._looked_at = float("-inf")
        self._lock = asyncio.Lock()

    async def body(self, request: Request, ids_field: str | None = None) -> Body:
        """The request's JSON body within --max-body-bytes (a large one parsed in a CPU worker,
        its `ids_field` as TokenIds when it holds token ids), read once: a route that speaks
        several APIs reads it to choose one (app.py), and the chosen handler gets the same."""
        body = getattr(request.state, "body", None)
        if body is None:
            body = request.state.body = await read_body(request, self.opts.max_body_bytes, self.offload, ids_field)
        return body

    async def catalog(self, max_age_s: float = 10.0) -> dict[str, ServedModel]:
        """The served models, looked up again when the last look is `max_age_s` old."""
        if not self._models:
            max_age_s = min(max_age_s, 0.5)  # nothing known yet: the server may have just come up
        async with self._lock:
            if time.monotonic() - self._looked_at >= max_age_s:
                for replica in list(self.pool.replicas.values()):
                    try:
                        self._models = await discover(replica.client, self.admin_token, self.names)
                        break
                    except Exception as e:  # noqa: BLE001 - this replica is down: ask the next
                        log.warning("cannot list models on %s: %s", replica.address, e)
                self._looked_at = time.monotonic()
            return self._models

    async def model(self, name: str | None, task: str) -> ServedModel:
        """The served model a request names (its task's default when it names none): 404 if
        there is none, 400 if it does the other task."""
        name = name or DEFAULT_MODELS[task]
        models = await self.catalog()
        if name not in models:
            models = await self.catalog(max_age_s=2.0)  # loaded since the last look?
        if not models:  # nothing reachable yet (starting, or every replica down): retry, not "unknown"
            raise GatewayError(503, "no Triton replica answers with a served model yet; retry shortly")
        if name not in models:
            served = ", ".join(m for m, v in models.items() if v.task == task) or "none"
            raise GatewayError(404, f"model {quote(name)} is not served here; models for this route: {served}", "model")
        model = models[name]
        if model.task != task:
            raise GatewayError(400, f"model {quote(name)} is a{'n' if model.task == 'embed' else ''} {model.task} "
                                    f"model; this route needs a{'n' if task == 'embed' else ''} {task} model",
                               "model")
        return model
