"""Which models the Triton servers serve, as the gateway's routes name them.

A served name is an ensemble of the repository (`embed`, `rerank`, `classify`, or a model's own name);
its first step names the model's parts (NAME_tokenizer, NAME_encoder), and the encoder's
config.pbtxt parameters carry the model's settings (pergola.config.engine.EngineConfig: limits,
dtype, pooling, kernels). With the admin token the repository index lists every ensemble;
without it the gateway looks for `embed`, `rerank`, `classify` and the names it was given.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from typing import Any

import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from pergola.config.engine import EngineConfig
from pergola.config.options import convert
from pergola.gateway.replicas import CONTROL_TIMEOUT_S
from pergola.outputs.heads import LABELS_PARAMETER, MAX_INPUT_PARAMETER, PROMPTS_PARAMETER
from pergola.text.chunking import ChunkLimits
from pergola.text.errors import StringLimits
from pergola.triton.admin import GRPC_ADMIN_HEADER

log = logging.getLogger("pergola.gateway")
ALIASES = ("embed", "rerank", "classify")
# EngineConfig's defaults by field, read once: dataclasses.fields() costs ~10 us a call, and
# admission asks for a limit on every request
_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)}


@dataclass(frozen=True)
class Pipeline:
    """The ensemble's two steps by tensor name, for the gateway to make them as two calls:
    Triton passes a gRPC client's cancellation to the model it calls, not to an ensemble's step in
    flight (a given-up ensemble call was encoded whole, a call straight to NAME_encoder not at all:
    perf/results/2026-12-06-a3538ba-cpu/NOTES.md), so bulk work goes to NAME_encoder itself."""

    inputs: dict[str, str]  # ensemble input -> NAME_tokenizer input
    feeds: dict[str, str]  # NAME_tokenizer output -> NAME_encoder input
    outputs: dict[str, tuple[int, str]]  # ensemble output -> (step: 0 tokenizer, 1 encoder; that model's output)


def pipeline(steps: list[dict[str, Any]]) -> Pipeline | None:
    """An ensemble config's steps (as_json) as a Pipeline, None unless tokenizer then encoder."""
    if len(steps) != 2:
        return None
    first, second = ({k: s.get(k, {}) for k in ("input_map", "output_map")} for s in steps)
    into_encoder = {tensor: name for name, tensor in second["input_map"].items()}
    feeds = {name: into_encoder[t] for name, t in first["output_map"].items() if t in into_encoder}
    outputs = {t: (0, name) for name, t in first["output_map"].items() if t not in into_encoder}
    outputs |= {t: (1, name) for name, t in second["output_map"].items()}
    return Pipeline({t: name for name, t in first["input_map"].items()}, feeds, outputs)


@dataclass
class ServedModel:
    name: str  # what requests say in `model`
    target: str  # the model behind it: NAME_tokenizer, NAME_encoder
    task: str  # "embed", "rerank" or "classify"
    settings: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields from config.pbtxt
    labels: list[str] = field(default_factory=list)  # a classifier's label names (config.pbtxt `labels`)
    outputs: tuple[str, ...] = ("dense",)  # an embedder's OUTPUTS: bge-m3's sparse / colbert where declared
    version: str | None = None  # the encoder's served version (the newest ready one), None if unknown
    pipeline: Pipeline | None = None  # the ensemble's steps (None: call the ensemble only)
    max_input_length: int | None = None  # tokens in the longest input (a rerank pair), None if not written
    gpu: bool = False  # the encoder's instances are on GPUs (KIND_GPU)
    tokenizer_instances: int = 1  # NAME_tokenizer's instances per replica
    prompts: tuple[str, ...] | None = None  # an embedding model's prompt names, None if not written

    def limit(self, name: str) -> Any:
        """An EngineConfig limit as this model's server has it (its default if not written)."""
        return self.settings[name] if name in self.settings else _DEFAULTS[name]

    @property
    def step_tokens(self) -> int:
        """The encoder's token budget per forward step (EngineConfig.step_tokens)."""
        return self.limit("max_batch_tokens") or (16384 if self.gpu else 1024)

    @property
    def dtype(self) -> str:
        """The compute dtype (EngineConfig.compute_dtype): "auto" is bfloat16 on a GPU, float32 on the CPU."""
        dtype = self.limit("dtype")
        return dtype if dtype != "auto" else "bfloat16" if self.gpu else "float32"

    def text_limits(self, count_option: str = "max_texts") -> StringLimits:
        return StringLimits(self.limit(count_option), self.limit("max_text_chars"),
                            self.limit("max_request_chars"), count_option)

    def chunk_limits(self) -> ChunkLimits:
        """How many windows `chunking` may cut one text, and one request's texts, into."""
        return ChunkLimits(self.limit("max_text_chunks"), self.limit("max_request_chunks"))


def _settings(parameters: dict[str, Any]) -> dict[str, Any]:
    """config.pbtxt parameters ({"key": {"string_value": "..."}}) as typed EngineConfig values."""
    out = {}
    for f in fields(EngineConfig):
        raw = parameters.get(f.name, {}).get("string_value")
        if raw is not None:
            try:
                out[f.name] = convert(f, raw)
            except (TypeError, ValueError):
                out[f.name] = raw
    return out


async def describe(client: grpcaio.InferenceServerClient, name: str) -> ServedModel | None:
    """The served model `name`, or None when it is not an ensemble of pergola's form."""
    try:
        config = (await client.get_model_config(name, as_json=True, client_timeout=CONTROL_TIMEOUT_S))["config"]
    except InferenceServerException:
        return None
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    if config.get("platform") != "ensemble" or not steps or not steps[0]["model_name"].endswith("_tokenizer"):
        return None
    target = steps[0]["model_name"].removesuffix("_tokenizer")
    task = "rerank" if any(i["name"] == "QUERY" for i in config.get("input", [])) else "embed"
    if any(o["name"] == "PROBS" for o in config.get("output", [])):
        task = "classify"
    try:
        encoder = (await client.get_model_config(f"{target}_encoder", as_json=True,
                                                 client_timeout=CONTROL_TIMEOUT_S))["config"]
    except InferenceServerException:
        return None
    parameters = encoder.get("parameters", {})
    labels = json.loads(parameters.get(LABELS_PARAMETER, {}).get("string_value") or "[]")
    longest = parameters.get(MAX_INPUT_PARAMETER, {}).get("string_value")
    prompts = parameters.get(PROMPTS_PARAMETER, {}).get("string_value")
    try:
        tokenizer = (await client.get_model_config(f"{target}_tokenizer", as_json=True,
                                                   client_timeout=CONTROL_TIMEOUT_S))["config"]
    except InferenceServerException:
        tokenizer = {}
    declared = {o["name"] for o in config.get("output", [])}
    outputs = ("dense", *(o for o, tensor in (("sparse", "SPARSE_INDICES"), ("colbert", "TOKEN_EMBEDDINGS"))
                          if tensor in declared))
    return ServedModel(name, target, task, _settings(parameters), labels, outputs,
                       await served_version(client, f"{target}_encoder"), pipeline(steps),
                       int(longest) if longest and longest.isdigit() else None,
                       any(g.get("kind") == "KIND_GPU" for g in encoder.get("instance_group", [])),
                       sum(int(g.get("count", 1)) for g in tokenizer.get("instance_group", [])) or 1,
                       tuple(json.loads(prompts)) if prompts else None)


async def served_version(client: grpcaio.InferenceServerClient, model: str) -> str | None:
    """The newest ready version of `model` (Triton serves one: version_policy latest 1)."""
    try:
        metadata = await client.get_model_metadata(model, as_json=True, client_timeout=CONTROL_TIMEOUT_S)
    except InferenceServerException:
        return None
    versions = [v for v in metadata.get("versions", []) if str(v).isdigit()]
    return max(versions, key=int) if versions else None


async def discover(client: grpcaio.InferenceServerClient, admin_token: str | None,
                   names: list[str]) -> dict[str, ServedModel]:
    """Served name -> model, for every ready ensemble the gateway can see."""
    candidates = list(ALIASES) + [n for n in names if n not in ALIASES]
    if admin_token:
        try:
            index = await client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: admin_token}, as_json=True,
                                                            client_timeout=CONTROL_TIMEOUT_S)
            candidates += [m["name"] for m in index.get("models", [])
                           if m.get("state") == "READY" and m["name"] not in candidates
                           and not m["name"].endswith(("_tokenizer", "_encoder"))]
        except InferenceServerException as e:
            log.warning("the repository index is closed to the gateway (%s); serving %s", e.message(), candidates)
    found = {}
    for name in candidates:
        model = await describe(client, name)
        if model is not None:
            found[name] = model
    return found
