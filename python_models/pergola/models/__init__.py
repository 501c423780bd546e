"""Model architectures (one file each) and the safetensors loader they share."""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pergola.hf_folder import ModelFolderError, ModelSpec

# architecture -> (module, class)
ARCHITECTURES = {
    "bert": ("pergola.models.bert", "BertModel"),
    "qwen3": ("pergola.models.qwen3", "Qwen3Model"),
}


def model_class(architecture: str) -> type[nn.Module]:
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module), name)


def _checkpoint_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"{folder}: no *.safetensors weights (convert .bin checkpoints first)")
    return files


def _target_name(name: str, model: nn.Module) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (parameter name, shard index inside a fused parameter)."""
    for prefix in getattr(model, "checkpoint_prefixes", ()):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for src, (dst, shard) in getattr(model, "packed_modules_mapping", {}).items():
        if src in name:
            return name.replace(src, dst), shard
    return name, None


def load_weights(model: nn.Module, folder: Path) -> None:
    """Copy safetensors weights into `model` (already on its device and dtype), fusing shards."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shards: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    num_shards: dict[str, int] = defaultdict(int)
    for dst, shard in getattr(model, "packed_modules_mapping", {}).values():
        num_shards[dst.rsplit(".", 1)[-1]] = max(num_shards[dst.rsplit(".", 1)[-1]], shard + 1)
    for path in _checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target, shard = _target_name(name, model)
                if target not in params:
                    if name in getattr(model, "extra_checkpoint_names", ()):
                        loaded |= model.load_extra(name, f.get_tensor(name))
                    continue  # pooler, heads this task does not use, position_ids buffers
                if shard is None:
                    params[target].data.copy_(f.get_tensor(name))
                    loaded.add(target)
                    continue
                shards[target][shard] = f.get_tensor(name)
                fused = target.rsplit(".", 2)[-2]
                if len(shards[target]) == num_shards[fused]:
                    parts = [shards[target][i] for i in range(num_shards[fused])]
                    params[target].data.copy_(torch.cat(parts, 0))
                    del shards[target]
                    loaded.add(target)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        loaded |= tie()
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelFolderError(f"{folder}: weights missing from the checkpoint: {missing[:8]}")


def _yes_no_ids(spec: ModelSpec) -> tuple[int, int]:
    """Token ids of "no" and "yes" (the Qwen3-Reranker answer words) in the folder's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    ids = tok.token_to_id("no"), tok.token_to_id("yes")
    if None in ids:
        raise ModelFolderError(f"{spec.path}: the tokenizer has no single 'yes'/'no' tokens for reranking")
    return ids  # type: ignore[return-value]


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Instantiate the architecture without initialising it, then load the folder's weights."""
    cls = model_class(spec.architecture)
    kwargs: dict = {"task": spec.task}
    if spec.architecture != "bert":
        kwargs["causal"] = spec.causal
        if spec.task == "rerank":
            kwargs["score_token_ids"] = _yes_no_ids(spec)
    with torch.device("meta"):
        model = cls(spec.hf_config, **kwargs)
    # Cast on the meta device (free), then allocate once in the compute dtype: allocating in fp32
    # and casting would put 2x the bf16 weights on the GPU first and run a cast per tensor.
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, spec.path)
    post_load = getattr(model, "post_load", None)
    if post_load is not None:
        post_load()
    return model.eval().requires_grad_(False)
