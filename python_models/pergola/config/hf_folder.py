"""Read a Hugging Face model folder (plus its sentence-transformers files) into a ModelSpec.

Everything pergola needs to know about a model that the folder itself decides lives here:
architecture, pooling, sentence-transformers Dense modules, normalisation, truncation length,
named prompts. Serving settings (device, token budget, limits) live in
`pergola.config.engine.EngineConfig` instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pergola.models import MODEL_TYPES, model_types, offset_positions

Pooling = Literal["mean", "cls", "last"]
Task = Literal["embed", "rerank", "classify"]

# Prompts a reranker's pairs may be laid out in (pergola.text.rerank.RERANK_KINDS; `rerank_prompt`).
RERANK_PROMPTS = ("cross-encoder", "qwen3-reranker", "mxbai-rerank-v2")
# sentence-transformers' module that scores a causal LM's last-token logits (CrossEncoder, 5.4+).
LOGIT_SCORE = "LogitScore"
# bge-m3's per-token heads (FlagEmbedding's BGEM3): the output each gives besides the dense vector,
# and the state dict beside the model that holds it. An embedding folder with them serves them.
TOKEN_HEADS = {"sparse": "sparse_linear.pt", "colbert": "colbert_linear.pt"}


class ModelFolderError(ValueError):
    """The folder is not a model pergola can serve; the message says what is missing."""


# sentence-transformers Dense activations (their saved `fullname`) pergola applies (pooling.py).
DENSE_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.modules.activation.Tanh",
                     "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.GELU",
                     "torch.nn.modules.activation.Sigmoid", "torch.nn.modules.activation.SiLU")


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers `Dense` module after pooling: activation(x @ W^T + b)."""

    path: Path  # its folder (2_Dense/): config.json and model.safetensors or pytorch_model.bin
    in_features: int
    out_features: int
    bias: bool
    activation: str  # one of DENSE_ACTIVATIONS


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    task: Task = "embed"
    pooling: Pooling = "mean"
    include_prompt: bool = True  # sentence-transformers: prompt tokens count in mean pooling
    normalize: bool = False
    max_seq_length: int = 512
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    causal: bool = False
    dense: tuple[DenseModule, ...] = ()  # sentence-transformers Dense modules, in order
    rerank_prompt: str | None = None  # a reranker's pair layout (RERANK_PROMPTS); None: the folder's
    answer_token_ids: tuple[int, int] | None = None  # (no, yes) ids of a LogitScore module, where present
    token_heads: tuple[str, ...] = ()  # bge-m3's heads found in the folder: keys of TOKEN_HEADS

    @property
    def outputs(self) -> tuple[str, ...]:
        """What an embedding request may ask for (OUTPUTS): the dense vector, and bge-m3's
        sparse lexical weights and ColBERT vectors where the folder has their heads."""
        return ("dense", *self.token_heads)

    @property
    def hidden_size(self) -> int:
        """Width of the pooled embedding: the last Dense module's output where the folder has
        Dense modules (EmbeddingGemma, LaBSE), else the transformer's hidden size."""
        return self.dense[-1].out_features if self.dense else int(self.hf_config["hidden_size"])

    @property
    def type_vocab_size(self) -> int:
        """Segment ids the model embeds: BERT's 2 (its default too); 1 (none) for XLM-R, MPNet,
        ModernBERT and the decoders."""
        default = 2 if self.hf_config.get("model_type") == "bert" else 1
        return int(self.hf_config.get("type_vocab_size") or default)

    @property
    def num_labels(self) -> int:
        return len(self.hf_config.get("id2label") or {0: "LABEL_0"})

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"


def sequence_classification(hf_config: dict[str, Any]) -> bool:
    """The checkpoint is a ...ForSequenceClassification head (config `architectures`)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf_config.get("architectures") or [])


def _logit_score(path: Path, modules: Any) -> tuple[int, int] | None:
    """(false, true) token ids of a sentence-transformers CrossEncoder's LogitScore module (a causal
    LM scored on two answer tokens' logits), or None where modules.json has none."""
    if not isinstance(modules, list):
        return None
    for module in modules:
        if str(module.get("type", "")).rsplit(".", 1)[-1] == LOGIT_SCORE:
            cfg = _read_json(path / str(module.get("path", "1_LogitScore")) / "config.json") or {}
            if cfg.get("true_token_id") is None or cfg.get("false_token_id") is None:
                raise ModelFolderError(f"{path}: a LogitScore module without both true_token_id and "
                                       "false_token_id is not supported (pergola scores logit(true) - logit(false))")
            return int(cfg["false_token_id"]), int(cfg["true_token_id"])
    return None


def head_dim(hf_config: dict[str, Any]) -> int:
    """Size of one attention head: `head_dim` where the config gives it (Qwen3), else hidden / heads."""
    return int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])


def _read_json(path: Path) -> dict[str, Any] | list[Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        return json.load(f)


# sentence-transformers pooling modes pergola serves: the 6.x `pooling_mode` value, or the
# earlier boolean key, -> pergola's name.
POOLING_MODES = {"lasttoken": "last", "cls": "cls", "mean": "mean"}
LEGACY_POOLING_KEYS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_cls_token": "cls",
                       "pooling_mode_mean_tokens": "mean"}


def _pooling_mode(path: Path, cfg: dict[str, Any]) -> Pooling:
    """1_Pooling/config.json -> pooling, in the 6.x format ("pooling_mode": "cls") or the earlier
    one ("pooling_mode_cls_token": true); an unsupported or concatenated mode is refused."""
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [name for key, name in LEGACY_POOLING_KEYS.items() if cfg.get(key)]
        modes += [k for k, v in cfg.items() if k.startswith("pooling_mode") and k not in LEGACY_POOLING_KEYS and v]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise ModelFolderError(f"{path}: pooling {modes} is not supported; use mean, cls or lasttoken pooling")
    return POOLING_MODES[modes[0]]  # type: ignore[return-value]


def _dense_module(path: Path, folder: str) -> DenseModule:
    """One Dense module's config.json, checked for what pergola can apply."""
    cfg = _read_json(path / folder / "config.json") or {}
    where = path / folder
    if not cfg:
        raise ModelFolderError(f"{where}: a Dense module without config.json")
    activation = str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))  # its default
    if activation not in DENSE_ACTIVATIONS:
        raise ModelFolderError(f"{where}: Dense activation {activation!r} is not supported; "
                               f"supported: {', '.join(a.rsplit('.', 1)[-1] for a in DENSE_ACTIVATIONS)}")
    if cfg.get("use_residual"):
        raise ModelFolderError(f"{where}: Dense modules with use_residual are not supported")
    return DenseModule(where, int(cfg["in_features"]), int(cfg["out_features"]), bool(cfg.get("bias", True)),
                       activation)


def _pooling_from_st(path: Path, modules: list[dict[str, Any]]
                     ) -> tuple[Pooling | None, bool, bool, tuple[DenseModule, ...]]:
    """(pooling mode, include_prompt, normalize, Dense modules) from sentence-transformers' modules.json."""
    pooling: Pooling | None = None
    include_prompt = True
    normalize = False
    dense: list[DenseModule] = []
    order = ["Transformer", "Pooling", "Dense", "Normalize"]  # the pipelines pergola serves, in this order
    seen = 0
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in order or order.index(kind) < seen:
            raise ModelFolderError(
                f"{path}: sentence-transformers module {module.get('type')!r} is not supported here "
                "(pergola serves Transformer -> Pooling -> Dense... -> Normalize pipelines)"
            )
        seen = order.index(kind)
        if kind == "Pooling":
            cfg = _read_json(path / module.get("path", "1_Pooling") / "config.json") or {}
            pooling = _pooling_mode(path, cfg)
            include_prompt = bool(cfg.get("include_prompt", True))
        elif kind == "Dense":
            dense.append(_dense_module(path, str(module.get("path", f"{module.get('idx')}_Dense"))))
        elif kind == "Normalize":
            normalize = True
    return pooling, include_prompt, normalize, tuple(dense)


def _check_dense(path: Path, dense: tuple[DenseModule, ...], pooling: Pooling, hidden: int) -> None:
    """Each Dense module takes what the one before gives (the runner applies them after pooling,
    as sentence-transformers does: pooling.DenseStack)."""
    widths = [hidden] + [d.out_features for d in dense]
    for d, width in zip(dense, widths):
        if d.in_features != width:
            raise ModelFolderError(f"{d.path}: in_features {d.in_features}, but its input is {width} wide")


def max_positions(hf_config: dict[str, Any]) -> int:
    """Longest sequence the position table covers. RoBERTa-family and MPNet positions start at
    pad_token_id + 1, so XLM-R's 514 rows hold 512 tokens."""
    limit = int(hf_config.get("max_position_embeddings", 512))
    if offset_positions(hf_config.get("model_type")):
        limit -= int(hf_config.get("pad_token_id", 1)) + 1
    return limit


def _default_max_len(hf_config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int:
    limit = max_positions(hf_config)
    tok_max = tokenizer_config.get("model_max_length")
    if isinstance(tok_max, (int, float)) and 0 < tok_max < limit:
        limit = int(tok_max)
    return limit


def load_model_spec(
    folder: str | Path,
    *,
    task: Task | None = None,
    pooling: Pooling | None = None,
    causal: bool | None = None,
    rerank_prompt: str | None = None,
) -> ModelSpec:
    """Read `folder`; explicit arguments override what the folder says. rerank_prompt: how a
    reranker's pairs are laid out (RERANK_PROMPTS): a yes/no prompt for a decoder (causal LM or
    ForSequenceClassification), "cross-encoder" for the tokenizer's pair template."""
    path = Path(folder).expanduser().resolve()
    hf_config = _read_json(path / "config.json")
    if not isinstance(hf_config, dict):
        raise ModelFolderError(f"{path}: no config.json; pass a Hugging Face model folder")
    if not (path / "tokenizer.json").is_file():
        raise ModelFolderError(f"{path}: no tokenizer.json (a fast tokenizer file is required)")
    model_type = str(hf_config.get("model_type", ""))
    if model_type not in MODEL_TYPES:
        raise ModelFolderError(
            f"{path}: model_type {model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}"
        )
    architecture = MODEL_TYPES[model_type]
    position_type = hf_config.get("position_embedding_type", "absolute")
    if architecture.name == "bert" and position_type not in ("absolute", None):
        raise ModelFolderError(f"{path}: position_embedding_type {position_type!r} is not supported; "
                               f"{model_type} folders are served with absolute position embeddings")
    archs = [str(a) for a in hf_config.get("architectures") or []]
    # A sequence-classification head: one label scores a pair (rerank), several classify a text.
    labels = len(hf_config.get("id2label") or {0: "LABEL_0"})
    folder_task: Task = "embed"
    if any(a.endswith("ForSequenceClassification") for a in archs):
        folder_task = "classify" if labels > 1 else "rerank"
    answer_tokens = _logit_score(path, _read_json(path / "modules.json"))
    if answer_tokens is not None:  # a CrossEncoder scoring a causal LM's answer tokens
        folder_task = "rerank"
    task = task or folder_task
    if task == "rerank" and "rerank" not in architecture.tasks:
        raise ModelFolderError(f"{path}: {model_type} is served as an embedder only; rerankers: {model_types('rerank')}")
    if rerank_prompt is not None:
        if rerank_prompt not in RERANK_PROMPTS:
            raise ModelFolderError(f"rerank prompt {rerank_prompt!r} is not one of {list(RERANK_PROMPTS)}")
        if task != "rerank":
            raise ModelFolderError(f"{path}: a rerank prompt applies to rerankers; this folder is served as {task}")
        decoder_lm = architecture.decoder and not sequence_classification(hf_config)
        yes_no = rerank_prompt != "cross-encoder"
        if (decoder_lm and not yes_no) or (yes_no and model_type not in ("qwen2", "qwen3")):
            raise ModelFolderError(
                f"{path}: rerank prompt {rerank_prompt!r} does not fit a {model_type} "
                f"{'causal LM' if decoder_lm else 'sequence classifier'}: the yes/no prompts (qwen3-reranker, "
                "mxbai-rerank-v2) serve Qwen2/Qwen3 causal LMs and their ForSequenceClassification heads, "
                "cross-encoder serves sequence classifiers")
    if task == "classify" and ("classify" not in architecture.tasks or labels < 2):
        raise ModelFolderError(f"{path}: classify serves a ...ForSequenceClassification head with several labels "
                               f"(config id2label) of {model_types('classify')}; this folder is {model_type} with "
                               f"{labels} label(s)")

    # A sentence-transformers embedding pipeline; a CrossEncoder's modules.json describes its head.
    modules = _read_json(path / "modules.json") if task == "embed" else None
    st_pooling, include_prompt, normalize, dense = (
        _pooling_from_st(path, modules) if isinstance(modules, list) else (None, True, False, ())
    )
    st_config = _read_json(path / "sentence_bert_config.json") or {}
    st_prompts = _read_json(path / "config_sentence_transformers.json") or {}
    tok_config = _read_json(path / "tokenizer_config.json") or {}

    is_decoder = architecture.decoder
    # Decoders attend causally unless the folder says otherwise: pplx-embed style
    # `use_bidirectional_attention`, or `is_causal: false` (gte-Qwen2's remote code reads it).
    bidirectional = hf_config.get("use_bidirectional_attention", False) or hf_config.get("is_causal") is False
    folder_causal = is_decoder and not bidirectional
    default_pooling: Pooling = "last" if is_decoder else "mean"
    # Never past the position table, whatever sentence_bert_config.json says.
    max_len = min(st_config.get("max_seq_length") or _default_max_len(hf_config, tok_config), max_positions(hf_config))
    prompts = {str(k): str(v) for k, v in (st_prompts.get("prompts") or {}).items()}
    default_prompt = st_prompts.get("default_prompt_name") or None
    if default_prompt is not None and default_prompt not in prompts:
        raise ModelFolderError(f"{path}: default_prompt_name {default_prompt!r} is not in prompts")

    if task in ("rerank", "classify"):  # the head reads the [CLS] state (cross-encoder) or the last token (LLM)
        default_pooling = "last" if is_decoder else "cls"
        if hf_config.get("classifier_pooling") == "mean":  # ModernBERT's sequence classification
            default_pooling = "mean"
    pooling = pooling or st_pooling or default_pooling
    _check_dense(path, dense, pooling, int(hf_config["hidden_size"]))
    return ModelSpec(
        path=path,
        architecture=architecture.name,
        hf_config=hf_config,
        task=task,
        pooling=pooling,
        include_prompt=include_prompt,
        normalize=normalize,
        max_seq_length=int(max_len),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        prompts=prompts,
        default_prompt_name=default_prompt,
        causal=folder_causal if causal is None else causal,
        dense=dense,
        rerank_prompt=rerank_prompt,
        answer_token_ids=answer_tokens if task == "rerank" else None,
        token_heads=tuple(h for h, f in TOKEN_HEADS.items() if (path / f).is_file()) if task == "embed" else (),
    )
