"""The safetensors loader (CPU): fused parameters filled part by part, a reranker's score rows read
from lm_head or the tied embeddings, and a checkpoint that leaves a parameter unset refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pergola.config.hf_folder import ModelFolderError, load_model_spec
from pergola.config.reranker import answer_ids
from pergola.models.loader import build_model
from safetensors.torch import load_file, save_file

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reranker(rerank_folders: dict[str, Path]) -> Path:
    if "qwen3-reranker" not in rerank_folders:
        pytest.skip("the real Qwen3 tokenizer is not available")
    return rerank_folders["qwen3-reranker"]


def rewrite(src: Path, dst: Path, edit, tie: bool | None = None) -> Path:
    """`src` (config, tokenizer, weights) with its weights through `edit(dict) -> dict` and
    tie_word_embeddings set."""
    dst.mkdir()
    (dst / "tokenizer.json").symlink_to(src / "tokenizer.json")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update({} if tie is None else {"tie_word_embeddings": tie})
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def build(folder: Path):
    return build_model(load_model_spec(folder, task="rerank"), CPU, torch.float32, {})


def test_fused_projections_hold_the_checkpoint_parts_in_order(reranker):
    model = build(reranker)
    weights = load_file(str(reranker / "model.safetensors"))
    p = "model.layers.1."
    qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    gate_up = torch.cat([weights[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, qkv)
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, gate_up)


def test_score_rows_come_from_the_tied_embeddings_or_lm_head(reranker, tmp_path):
    no, yes = answer_ids(load_model_spec(reranker, task="rerank"))
    embed = load_file(str(reranker / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(build(reranker).score_weight, embed[[no, yes]])  # tied: no lm_head tensor

    head = torch.randn_like(embed)
    untied = rewrite(reranker, tmp_path / "untied", lambda w: {**w, "lm_head.weight": head}, tie=False)
    assert torch.equal(build(untied).score_weight, head[[no, yes]])

    headless = rewrite(reranker, tmp_path / "headless", lambda w: w, tie=False)
    with pytest.raises(ModelFolderError, match="score_weight"):
        build(headless)


def test_a_missing_part_of_a_fused_parameter_is_named(rerank_folders, tmp_path):
    folder = rerank_folders["cross-encoder"]
    key = next(k for k in load_file(str(folder / "model.safetensors")) if k.endswith("layer.0.attention.self.key.bias"))
    broken = rewrite(folder, tmp_path / "broken", lambda w: {k: v for k, v in w.items() if k != key})
    with pytest.raises(ModelFolderError, match=r"encoder\.layer\.0\.attention\.self\.qkv\.bias"):
        build(broken)
