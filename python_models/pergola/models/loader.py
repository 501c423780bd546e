"""The base class of the architectures (pergola.models registers them) and the safetensors loader they share.

Loading follows nano-vllm: every parameter carries a `weight_loader(param, tensor, shard_id=None)`
(a fused projection copies each checkpoint part straight into its rows, pergola.layers.linear;
the default copies the whole tensor), and each architecture declares how checkpoint names map
onto its parameters in the attributes of `Model`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pergola.config.hf_folder import ModelFolderError, ModelSpec
from pergola.config.reranker import answer_ids, yes_no_head
from pergola.layers.fp8 import check_supported, quantize_layers
from pergola.layers.linear import TileTable, default_weight_loader, select_tiles
from pergola.models import ARCHITECTURES, model_class
from pergola.outputs.pooling import attach_dense

log = logging.getLogger(__name__)


class Model(nn.Module):
    """An architecture as the loader reads it. Defaults: checkpoint names are parameter names."""

    # Stripped from checkpoint names first (the "bert." of BertForSequenceClassification checkpoints).
    checkpoint_prefixes: tuple[str, ...] = ()
    # Checkpoint module -> (fused module, part index), e.g. "self_attn.k_proj" -> ("self_attn.qkv_proj", 1).
    packed_modules_mapping: dict[str, tuple[str, int]] = {}
    # Checkpoint tensor -> a parameter outside Hugging Face's module tree that loads from it too
    # (a reranker's score rows, cut from lm_head or the tied embeddings by their weight_loader).
    extra_targets: dict[str, str] = {}

    def post_load(self) -> None:
        """Fill what is computed rather than read (RoPE tables), once the weights are in."""

    def takes_rows(self, pooling: str) -> bool:
        """Whether forward() takes `rows` ([B] int64, the token each sequence is pooled from, in
        `pooling`'s mode) and then returns the last hidden states of those rows only, [B, hidden]:
        the last layer computes keys and values from every token and the rest from the rows alone
        (pergola.layers.attention.attend_rows). An architecture that can says so."""
        return False

    def fold_norms(self) -> bool:
        """Fold norm gains into the projections after them, where the architecture can (Qwen3);
        -> whether it did. Called after loading, never for FP8 weights."""
        return False


def _checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{folder}: no *.safetensors weights (convert .bin checkpoints first)")
    return files


def _targets(model: Model, name: str) -> list[tuple[str, int | None]]:
    """Checkpoint tensor name -> [(parameter name, part index inside a fused parameter)]."""
    for prefix in model.checkpoint_prefixes:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    extra = [(model.extra_targets[name], None)] if name in model.extra_targets else []
    for src, (dst, shard) in model.packed_modules_mapping.items():
        if src in name:
            return [(name.replace(src, dst), shard), *extra]
    return [(name, None), *extra]


def _parts(model: Model, param_name: str) -> set[int | None]:
    """The part indices a parameter loads from ({None}: one whole tensor)."""
    return {shard for dst, shard in model.packed_modules_mapping.values() if f"{dst}." in param_name} or {None}


def load_weights(model: Model, folder: Path) -> None:
    """Copy safetensors weights into `model` (already on its device and dtype) through each
    parameter's weight_loader; a parameter, or a part of a fused one, left unread is an error."""
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int | None]] = set()
    for path in _checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                # Names matching no parameter: pooler, heads this task does not use, position_ids buffers.
                targets = [(target, shard) for target, shard in _targets(model, name) if target in params]
                tensor = f.get_tensor(name) if targets else None
                for target, shard in targets:
                    param = params[target]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
                    loaded.add((target, shard))
    missing = sorted({name for name in params for part in _parts(model, name) if (name, part) not in loaded})
    if missing:
        raise ModelFolderError(f"{folder}: weights missing from the checkpoint: {missing[:8]}")


def _materialize(model: Model, device: torch.device, dtype: torch.dtype) -> Model:
    """A model built on the meta device, allocated on `device` in `dtype` (uninitialised).

    Casting on the meta device is free, and allocating once in the compute dtype avoids putting
    2x the bf16 weights on the GPU first and a cast per tensor. The new tensors do not keep the
    Python attributes of the meta ones, so each parameter's weight_loader is carried over.
    """
    attributes = {name: dict(vars(param)) for name, param in model.named_parameters()}
    model = model.to(dtype).to_empty(device=device)
    for name, param in model.named_parameters():
        vars(param).update(attributes[name])
    return model


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """Module constructors skip their random fills (torch.nn.init's in-place functions do nothing):
    the model is built on the meta device and its memory comes uninitialised from _materialize.

    Why: on the meta device nn.Embedding's normal_ runs as a Python reference whose first call
    imports torch._dynamo, 3.4 s of a MiniLM encoder's 3.7 s build on the 2-core CPU host (7.4 of
    8.2 s while that host was busy), paid at every stub start and every per-model recovery
    (pergola/triton/supervisor.py). Not thread-safe: it swaps torch.nn.init's functions while it runs."""
    names = [n for n in vars(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))]
    saved = {n: getattr(nn.init, n) for n in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, tiles: TileTable,
                quantization: str = "none", fold_norms: bool = False, fp8_bf16_layers: int = 0) -> Model:
    """Instantiate the architecture without initialising it, load the folder's weights, and give
    each projection its rows of `tiles` (layers.linear.tiles_for this device).

    quantization "fp8": the transformer layers' projections become FP8 once loaded, but for the
    first and last `fp8_bf16_layers` layers (layers.fp8.quantize_layers; refused where FP8 cannot
    run, before any weight is read).
    fold_norms: norm gains go into the projections after them where the architecture can
    (`Model.fold_norms`; not with FP8, whose fidelity was measured with the norms in place).
    """
    if quantization == "fp8":
        check_supported(device, dtype)
    kwargs: dict = {"task": spec.task}
    if ARCHITECTURES[spec.architecture].decoder:  # its attention is causal or not as the folder says
        kwargs["causal"] = spec.causal
    if yes_no_head(spec):  # a causal LM reranker: the answer tokens' rows of its LM head
        kwargs["answer_ids"] = answer_ids(spec)
    with torch.device("meta"), _no_random_init():
        model = model_class(spec.architecture)(spec.hf_config, **kwargs)
    model = _materialize(model, device, dtype)
    load_weights(model, spec.path)
    model.post_load()
    if fold_norms and quantization == "none" and model.fold_norms():
        log.info("norm gains folded into the projections after them (fewer kernels per layer)")
    if quantization == "fp8":  # before the Dense stack is attached: heads stay in the model dtype
        skipped = quantize_layers(model, spec.hf_config["num_hidden_layers"], fp8_bf16_layers)
        if skipped:
            log.warning("fp8: %d projections keep BF16 weights (K or N not a multiple of 16): %s", len(skipped),
                        ", ".join(skipped[:8]))
    if spec.dense:  # sentence-transformers Dense modules after pooling (EmbeddingGemma, LaBSE)
        attach_dense(model, spec.dense, device, dtype)
    select_tiles(model, tiles)
    return model.eval().requires_grad_(False)
