"""One validated serving config per model, parsed from config.pbtxt parameters in one place."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from pergola.config.hf_folder import RERANK_PROMPTS, ModelSpec, load_model_spec
from pergola.config.options import convert, option
from pergola.text.chunking import ChunkLimits
from pergola.text.errors import StringLimits

DTYPES = ("float32", "bfloat16", "float16")
# The names of pergola.layers.attention.BACKENDS, spelled out because this module must import
# without torch (tokenizer instances and the CLI read it); tests/test_attention_backends.py keeps
# the two equal.
ATTENTION_BACKENDS = ("auto", "sdpa", "torch_flash", "flashinfer_fa2", "flashinfer_fa3", "flash_attn4", "triton")
# pergola.layers.fp8.QUANTIZATIONS, spelled out for the same reason (tests/test_fp8.py keeps them equal).
QUANTIZATIONS = ("none", "fp8")
# cuda_graph_max_tokens' default; the attention probe's largest class of graph steps ends there.
CUDA_GRAPH_MAX_TOKENS = 4096


@dataclass
class EngineConfig:
    """Serving settings of one model: every field is a config.pbtxt parameter of the same name,
    and (unless cli=False) a `pergola serve` flag and a PERGOLA_<NAME> variable (pergola.config.options)."""

    model_dir: str = option(MISSING, "Hugging Face folder (weights, tokenizer, sentence-transformers files)", cli=False)
    model_id: str | None = option(None, "the Hub id the folder is a snapshot of (ORG/NAME; pergola.config.hub)", cli=False)
    model_revision: str | None = option(None, "the commit of model_id that the snapshot holds", cli=False)
    device: str = option("cpu", "cpu or cuda:N; the Triton instance decides", cli=False)
    dtype: str = option("auto", "compute dtype; auto: bfloat16 on a GPU, float32 on the CPU",
                        choices=("auto",) + DTYPES)
    max_batch_tokens: int = option(0, "token budget of one forward step; 0: 16384 on a GPU, 1024 on a CPU, where "
                                      "larger steps are slower per token and hold a query up for seconds")
    query_tokens: int = option(2048, "requests of at most this many tokens (queries) take a lane of their own: "
                                     "their steps come first and run between the layers of a large "
                                     "step in flight, so a query waits about one layer, not a whole step "
                                     "(engine/loop.py; perf/results/2026-12-04-c60177f/NOTES.md); 0: one lane "
                                     "for all")
    query_fill_tokens: int = option(0, "GPU only: top a queries' step up with queued bulk sequences to this many "
                                       "tokens (at most query_tokens). Bulk work then loses less to queries, "
                                       "but a query waits for the larger step (perf/results/2026-12-04-43e5651/"
                                       "NOTES.md); 0: queries' steps hold queries only")
    max_batch_seqs: int = option(256, "most sequences in one forward step (bounds graph keys and pooling buffers)")
    max_texts: int = option(2048, "most texts in one embedding request (OpenAI's own maximum)")
    max_documents: int = option(2048, "most documents in one rerank request")
    max_text_chars: int = option(1_000_000, "most characters in one text or document; longer ones are refused "
                                            "before any tokenization (INVALID_ARG)")
    max_request_chars: int = option(8_000_000, "most characters in one request, all its texts (or the query "
                                               "and its documents) together")
    max_query_chars: int = option(32_768, "most characters in a rerank query (it is never truncated)")
    max_text_chunks: int = option(4096, "most windows one text may be cut into by `chunking` "
                                        "(docs/long-documents.md); more are refused (413) before any encoding")
    max_request_chunks: int = option(16_384, "most windows all the texts of one `chunking` request may be cut "
                                             "into")
    max_queue_seconds: float = option(10.0, "refuse new work at once (UNAVAILABLE) while the encoder's queued "
                                            "tokens would take longer than this at its measured throughput; a "
                                            "request that could not finish within its own `timeout` is refused "
                                            "too (0: no limit)")
    truncate: bool = option(True, "default for requests that do not say: cut texts over the model's limit "
                                  "(--no-truncate: refuse them)")
    attention_backend: str = option("auto", "ragged attention kernel; auto: the start-up probe times the "
                                            "available ones on this GPU and picks (docs/gpu.md: Attention kernel choice)",
                                    choices=ATTENTION_BACKENDS)
    eager_attention_backend: str = option("auto", "kernel for steps above the CUDA-graph crossover; auto: the "
                                                  "probe's pick for 16k-token steps", choices=ATTENTION_BACKENDS)
    probe_fa4: bool = option(False, "let the start-up probe time FlashAttention-4 (it compiles its kernels "
                                    "first, seconds on every model load)")
    enforce_eager: bool = option(False, "never capture CUDA graphs")
    cuda_graph_max_tokens: int = option(CUDA_GRAPH_MAX_TOKENS, "steps with more tokens run eagerly (the "
                                                               "launch-vs-GPU-time crossover)")
    matmul: str = option("auto", "auto: Triton tiles where they measured faster on this GPU (a built-in "
                                 "H100/H200 table), else cuBLAS; cublas; or a tile-table JSON from "
                                 "perf/bench_gemm.py --write-tiles", metavar="auto|cublas|FILE")
    quantization: str = option("none", "fp8: the transformer layers' projections in FP8 (e4m3 weights with a "
                                       "scale per output channel, activations with a scale per token; GPUs of "
                                       "compute capability 8.9+, dtype bfloat16); norms, attention, pooling, "
                                       "embeddings and heads stay in BF16 (docs/gpu.md: FP8)",
                                choices=QUANTIZATIONS)
    fp8_bf16_layers: int = option(1, "with --quantization fp8: the first and the last N transformer layers keep "
                                     "BF16 weights: the end layers lift the lowest per-text cosine to BF16 the "
                                     "most per matmul kept (perf/results/2026-12-05-614fe80-cpu/NOTES.md); 0: "
                                     "every layer in FP8")
    fold_norms: bool = option(True, "Qwen3: fold each layer's two RMSNorm gains into the q/k/v and gate/up "
                                    "weights; the kernels after those matmuls apply 1/rms, so a layer runs two "
                                    "kernels fewer (perf/results/2026-12-06-dee4f3a/NOTES.md); not with FP8")
    prune_last_layer: bool = option(True, "CLS or last-token pooling: the last layer's attention output, MLP and "
                                          "final norm run on each sequence's pooled token only (its keys and "
                                          "values still come from every token), 1/layers of the compute saved, "
                                          "2-5% more embeddings/s (perf/results/2026-12-07-5e52bd5/NOTES.md); "
                                          "not for steps that return per-token rows (bge-m3's sparse / ColBERT, "
                                          "late chunking)")
    cpu_threads: int = option(0, "torch threads of a CPU encoder instance; 0: the cores less one, so Triton's "
                                 "own threads keep a core (with every core taken, batch-1 requests stalled "
                                 "now and then; perf/results/2026-12-03-a4c7de7/NOTES.md)")
    metrics_flush_s: float = option(1.0, "pergola's counters reach Triton at most this often (seconds; 0: after "
                                         "every batch), histograms a tenth as often: each update is a "
                                         "stub-to-server round trip")
    task: str | None = option(None, "override what the folder says (rerank for a yes/no causal LM reranker: "
                                    "Qwen3-Reranker, mxbai-rerank-v2; classify: a sequence-classification head "
                                    "with several labels)",
                              choices=("embed", "rerank", "classify"))
    rerank_prompt: str | None = option(None, "a reranker's pair layout, where the folder's is not the one: "
                                             "qwen3-reranker or mxbai-rerank-v2 (the yes/no prompts, for a Qwen3 "
                                             "or Qwen2 causal LM or a score head converted from one), "
                                             "cross-encoder (the tokenizer's pair template)",
                                       choices=RERANK_PROMPTS)
    pooling: str | None = option(None, "override the folder's pooling", choices=("mean", "cls", "last"))
    causal: bool | None = option(None, "override the folder's attention mask (causal or bidirectional)")
    query_prompt: str | None = option(None, "prefix (or prompt name) for PROMPT_NAME=query when the folder has none")
    document_prompt: str | None = option(None, "prefix (or prompt name) for PROMPT_NAME=document when the "
                                               "folder has none")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("attention_backend", "eager_attention_backend"):
            if getattr(self, name) not in ATTENTION_BACKENDS:
                raise ValueError(f"{name} must be one of {ATTENTION_BACKENDS}, got {getattr(self, name)!r}")
        for name in ("query_tokens", "query_fill_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"max_batch_tokens must be 0 (auto) or positive, got {self.max_batch_tokens}")
        for name in ("max_batch_seqs", "max_texts", "max_documents", "max_text_chars",
                     "max_request_chars", "max_query_chars", "max_text_chunks", "max_request_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.fp8_bf16_layers < 0:
            raise ValueError(f"fp8_bf16_layers must be 0 or positive, got {self.fp8_bf16_layers}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be 0 (auto) or positive, got {self.cpu_threads}")
        if self.max_queue_seconds < 0:
            raise ValueError(f"max_queue_seconds must be 0 (no limit) or positive, got {self.max_queue_seconds}")
        if self.metrics_flush_s < 0:
            raise ValueError(f"metrics_flush_s must be 0 or positive, got {self.metrics_flush_s}")
        if self.matmul not in ("auto", "cublas"):
            if not Path(self.matmul).is_file():
                raise ValueError(f"matmul must be 'auto', 'cublas' or a tile-table JSON file, got {self.matmul!r}")
            self.matmul = str(Path(self.matmul).resolve())  # the Triton stub runs in another directory
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "fp8" and self.dtype in ("float32", "float16"):
            raise ValueError(f"quantization fp8 needs dtype bfloat16 (FP8 matmuls write BF16), got dtype "
                             f"{self.dtype}: use --dtype bfloat16 (or auto) or --quantization none")
        for name in ("task", "pooling", "rerank_prompt"):
            choices = next(f for f in fields(self) if f.name == name).metadata["choices"]
            if getattr(self, name) is not None and getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices} (or unset), got {getattr(self, name)!r}")

    @property
    def step_tokens(self) -> int:
        """The token budget in use: max_batch_tokens, or its per-device default."""
        if self.max_batch_tokens:
            return self.max_batch_tokens
        return 1024 if self.device == "cpu" else 16384

    @property
    def compute_dtype(self) -> str:
        """The dtype actually used: "auto" is bfloat16 on a GPU, float32 on the CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    def spec(self) -> ModelSpec:
        """The model folder's spec with this config's overrides applied."""
        spec = load_model_spec(self.model_dir, task=self.task, pooling=self.pooling,  # type: ignore[arg-type]
                               causal=self.causal, rerank_prompt=self.rerank_prompt)
        prompts = dict(spec.prompts)
        for name, value in (("query", self.query_prompt), ("document", self.document_prompt)):
            if value and name not in prompts:
                prompts[name] = prompts.get(value, value)
        if prompts == spec.prompts:
            return spec
        from dataclasses import replace

        return replace(spec, prompts=prompts)

    def text_limits(self) -> StringLimits:
        """What one embedding request's TEXT may hold."""
        return StringLimits(self.max_texts, self.max_text_chars, self.max_request_chars, "max_texts")

    def chunk_limits(self) -> ChunkLimits:
        """How many windows `chunking` may cut one text, and one request's texts, into."""
        return ChunkLimits(self.max_text_chunks, self.max_request_chunks)

    def document_limits(self) -> StringLimits:
        """What one rerank request's DOCUMENTS may hold (the query is counted in the total)."""
        return StringLimits(self.max_documents, self.max_text_chars, self.max_request_chars, "max_documents")

    def query_limits(self) -> StringLimits:
        return StringLimits(1, self.max_query_chars, self.max_request_chars, "one query")

    @classmethod
    def from_parameters(cls, params: dict[str, str], **overrides: Any) -> EngineConfig:
        """Build from string parameters (config.pbtxt), converting each to its field's type."""
        kwargs: dict[str, Any] = {f.name: convert(f, params[f.name], f"parameter {f.name}")
                                  for f in fields(cls) if f.name in params}
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_triton_args(cls, args: dict[str, str], **overrides: Any) -> EngineConfig:
        """From the `args` Triton passes to `initialize`: parameters plus the version folder's hf/."""
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        if "model_dir" not in params or not params["model_dir"]:
            params["model_dir"] = str(version_dir / "hf")
        return cls.from_parameters(params, **overrides)

    def to_parameters(self) -> dict[str, str]:
        """config.pbtxt parameters: every field that is set (None fields are left out)."""
        return {key: str(value).lower() if isinstance(value, bool) else str(value)
                for key, value in asdict(self).items() if value is not None}


@dataclass
class TritonModelOptions:
    """What Triton's config.pbtxt says about one model's tokenizer and encoder (repo_builder)."""

    tokenizer_instances: int = option(2, "tokenizer instances per model (CPU processes tokenizing in parallel)")
    max_batch_requests: int = option(64, "most requests Triton hands the encoder in one execute()")
    max_queue_size: int = option(0, "requests that may wait in Triton's queue for the encoder; more are refused "
                                    "at once (UNAVAILABLE); 0: no limit there, the encoder sheds load by queued "
                                    "work itself (--max-queue-seconds). Any limit here, or --queue-timeout-ms, "
                                    "turns off Triton's batch prefetching: a request arriving during an "
                                    "execute() may then wait up to 500 ms")
    queue_timeout_ms: int = option(0, "refuse requests that waited longer than this in Triton's queue for the "
                                      "encoder, and honour each request's own timeout there (0: neither; see "
                                      "--max-queue-size)")

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < (0 if f.name in ("queue_timeout_ms", "max_queue_size") else 1):
                raise ValueError(f"{f.name} must be positive, got {getattr(self, f.name)}")

    @property
    def queue_policy(self) -> bool:
        """Whether Triton's queue for the encoder has a policy (a size or time limit); without one
        its dynamic batcher prefetches (scheduler_utils.cc, PriorityQueue: timeout 0, no override,
        max_queue_size 0)."""
        return bool(self.max_queue_size or self.queue_timeout_ms)
