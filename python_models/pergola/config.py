"""One validated serving config per model, parsed from config.pbtxt parameters in one place."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pergola.hf_folder import ModelSpec, load_model_spec

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "sdpa", "torch_flash", "flashinfer_fa2", "flashinfer_fa3", "flash_attn4", "triton")


@dataclass
class EngineConfig:
    """Serving settings of one model. Every field is a config.pbtxt parameter of the same name.

    model_dir:         Hugging Face folder (weights, tokenizer, sentence-transformers files).
    device:            "cpu" or "cuda" (the Triton instance's GPU is picked by the adapter).
    dtype:             compute dtype; "auto" means bfloat16 on GPU, float32 on CPU.
    max_batch_tokens:  token budget of one forward step (FCFS packing stops there).
    max_batch_seqs:    sequence cap of one step (bounds graph keys and pooling buffers).
    max_texts:         most texts one request may carry.
    truncate:          default for requests that do not say: cut long texts (True) or refuse them.
    attention_backend: one of ATTENTION_BACKENDS; "auto" picks per device.
    eager_attention_backend: backend for steps above the graph crossover ("auto": the same).
    enforce_eager:     never capture CUDA graphs.
    cuda_graph_max_tokens: steps with more tokens run eagerly (the launch-vs-GPU-time crossover).
    matmul:            "auto" (Triton tiles where measured faster on this GPU, else cuBLAS),
                       "cublas", or the path of a tile table from perf/bench_gemm.py --write-tiles.
    cpu_threads:       torch intra-op threads of a CPU model instance in the server (0: one fewer
                       than the cores the process may use, at least 1). On 2 cores, 2 threads left
                       Triton's own threads no core and 4-10% of batch-1 requests stalled ~0.5 s;
                       with 1, about none did (perf/RESULTS.md, session 7).
    query_prompt / document_prompt: prompt names or literal prefixes used for the `query` and
                       `document` prompt names when the folder defines none.
    """

    model_dir: str
    device: str = "cpu"
    dtype: str = "auto"
    max_batch_tokens: int = 16384
    max_batch_seqs: int = 256
    max_texts: int = 1024
    truncate: bool = True
    attention_backend: str = "auto"
    eager_attention_backend: str = "auto"
    enforce_eager: bool = False
    cuda_graph_max_tokens: int = 4096
    matmul: str = "auto"
    cpu_threads: int = 0
    query_prompt: str = ""
    document_prompt: str = ""
    task: str = ""
    pooling: str = ""
    causal: str = ""  # "", "true" or "false": override of the folder's attention mask

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("attention_backend", "eager_attention_backend"):
            if getattr(self, name) not in ATTENTION_BACKENDS:
                raise ValueError(f"{name} must be one of {ATTENTION_BACKENDS}, got {getattr(self, name)!r}")
        for name in ("max_batch_tokens", "max_batch_seqs", "max_texts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be 0 (auto) or positive, got {self.cpu_threads}")
        if self.matmul not in ("auto", "cublas"):
            if not Path(self.matmul).is_file():
                raise ValueError(f"matmul must be 'auto', 'cublas' or a tile-table JSON file, got {self.matmul!r}")
            self.matmul = str(Path(self.matmul).resolve())  # the Triton stub runs in another directory
        if self.causal not in ("", "true", "false"):
            raise ValueError(f"causal must be '', 'true' or 'false', got {self.causal!r}")

    @property
    def compute_dtype(self) -> str:
        """The dtype actually used: "auto" is bfloat16 on a GPU, float32 on the CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    def spec(self) -> ModelSpec:
        """The model folder's spec with this config's overrides applied."""
        spec = load_model_spec(
            self.model_dir,
            task=self.task or None,  # type: ignore[arg-type]
            pooling=self.pooling or None,  # type: ignore[arg-type]
            causal=None if not self.causal else self.causal == "true",
        )
        prompts = dict(spec.prompts)
        for name, value in (("query", self.query_prompt), ("document", self.document_prompt)):
            if value and name not in prompts:
                prompts[name] = prompts.get(value, value)
        if prompts == spec.prompts:
            return spec
        from dataclasses import replace

        return replace(spec, prompts=prompts)

    @classmethod
    def from_parameters(cls, params: dict[str, str], **overrides: Any) -> "EngineConfig":
        """Build from string parameters (config.pbtxt), converting each to its field's type."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in params:
                continue
            raw = params[f.name]
            if f.type == "bool":
                if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(f"parameter {f.name} must be true or false, got {raw!r}")
                kwargs[f.name] = raw.lower() in ("true", "1", "yes")
            elif f.type == "int":
                kwargs[f.name] = int(raw)
            else:
                kwargs[f.name] = raw
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_triton_args(cls, args: dict[str, str], **overrides: Any) -> "EngineConfig":
        """From the `args` Triton passes to `initialize`: parameters plus the version folder's hf/."""
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        if "model_dir" not in params or not params["model_dir"]:
            params["model_dir"] = str(version_dir / "hf")
        return cls.from_parameters(params, **overrides)

    def to_parameters(self) -> dict[str, str]:
        out = {}
        for key, value in asdict(self).items():
            out[key] = str(value).lower() if isinstance(value, bool) else str(value)
        return out
