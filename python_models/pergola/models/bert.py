"""BERT family encoder (BERT, MiniLM, RoBERTa, XLM-RoBERTa) over flat tokens: [num_tokens, hidden], no padding.

Module and weight names follow Hugging Face's `BertModel`, so checkpoints load by name; the
query/key/value projections are one fused `qkv` matmul, loaded part by part (`packed_modules_mapping`).
RoBERTa and XLM-RoBERTa are the same network with two differences, both decided by the config's
`model_type`: positions count from `pad_token_id + 1` (fairseq's convention), and the
sequence-classification head is `classifier.dense` + tanh + `classifier.out_proj` on the <s>
state instead of BERT's pooler + classifier.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pergola.config.hf_folder import ModelFolderError, head_dim
from pergola.layers.attention import AttentionBackend, AttentionMetadata, attend_rows
from pergola.layers.fused import ACTIVATIONS, layer_norm, use_triton
from pergola.layers.linear import Linear, MergedLinear, linear
from pergola.models.loader import Model
from pergola.outputs.heads import HEAD_TASKS

# HF model types served by this file whose positions follow RoBERTa (fairseq) numbering.
ROBERTA_TYPES = ("roberta", "xlm-roberta")


def is_roberta(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") in ROBERTA_TYPES


def roberta_positions(input_ids: torch.Tensor, positions: torch.Tensor, pad_id: int) -> torch.Tensor:
    """RoBERTa position ids over a ragged batch, as HF's `create_position_ids_from_input_ids`:
    each sequence numbers its non-padding tokens pad_id + 1, pad_id + 2, ...; a padding token
    (a literal "<pad>" in the text) gets pad_id and does not advance the count.

    input_ids, positions: [T] int64 (positions restart at 0 per sequence) -> [T] int64. No host
    sync: the count before each sequence's first token is read with a gather, so it runs in a graph.
    """
    real = (input_ids != pad_id).long()
    count = real.cumsum(0)  # [T] real tokens up to and including each token, over the whole batch
    first = torch.arange(input_ids.shape[0], device=input_ids.device) - positions  # [T] its sequence's start
    before = count[first] - real[first]  # real tokens of the earlier sequences
    return (count - before) * real + pad_id


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))
        # RoBERTa family: positions offset past the padding index (None: BERT, positions as given).
        self.pad_id: int | None = int(cfg.get("pad_token_id", 1)) if is_roberta(cfg) else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        if self.pad_id is not None:
            positions = roberta_positions(input_ids, positions, self.pad_id)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.head_dim = head_dim(cfg)
        self.qkv = MergedLinear(h, [h, h, h], bias=True)  # fused query | key | value

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with `rows` ([B] pooled tokens) the rows' outputs only, [B, hidden]."""
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        if rows is not None:
            return attend_rows(q[rows], k, v, meta.cu_seqlens, meta.max_seqlen).reshape(rows.shape[0], -1)
        return attn(q, k, v, meta).reshape(t, -1)


class BertLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, inter, eps = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("layer_norm_eps", 1e-12)
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = nn.Module()
        self.attention.output.dense = Linear(h, h, bias=True)
        self.attention.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = Linear(h, inter, bias=True)
        self.output = nn.Module()
        self.output.dense = Linear(inter, h, bias=True)
        self.output.LayerNorm = nn.LayerNorm(h, eps=eps)
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ModelFolderError(f"hidden_act {act!r} is not supported (one of {sorted(ACTIVATIONS)})")
        self.act = act  # a key of ACTIVATIONS: Linear.activated runs GELU in the matmul's epilogue

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: intermediate, activation, output, residual + LayerNorm."""
        return add_norm(self.output.dense, self.intermediate.dense.activated(x, self.act), x, self.output.LayerNorm)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, attn: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attention.self(x, meta, attn, rows)
        if rows is not None:  # the last layer of a row-pooled step: [B, hidden] from here on
            x = x[rows]
        return self.feed_forward(add_norm(self.attention.output.dense, a, x, self.attention.output.LayerNorm))


def add_norm(dense: Linear, h: torch.Tensor, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """LayerNorm(dense(h) + x), h [T, in] and x [T, hidden] -> [T, hidden].

    On the GPU two kernels instead of three: the residual add rides in the matmul's epilogue (in
    place in x, this forward's own stream: cuBLAS beta = 1) and the bias in the norm's kernel, so
    [T, hidden] is read twice fewer and written once fewer than by matmul + add + LayerNorm.
    """
    if use_triton(x) and dense.weight_scale is None and dense.bias is not None:
        return layer_norm(linear(h, dense.weight, x), norm.weight, norm.bias, norm.eps, pre_bias=dense.bias)
    return norm(dense(h) + x)


class BertModel(Model):
    """Returns the last hidden states [num_tokens, hidden] of a ragged batch."""

    # checkpoint name -> (fused parameter, shard index)
    packed_modules_mapping = {
        "attention.self.query": ("attention.self.qkv", 0),
        "attention.self.key": ("attention.self.qkv", 1),
        "attention.self.value": ("attention.self.qkv", 2),
    }
    # BertForSequenceClassification ("bert."), (XLM-)RobertaForSequenceClassification ("roberta.").
    checkpoint_prefixes = ("bert.", "roberta.", "model.")
    causal = False

    def __init__(self, cfg: dict[str, Any], task: str = "embed") -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        if task in HEAD_TASKS:  # a sequence-classification head (reranker or classifier)
            h, labels = cfg["hidden_size"], len(cfg.get("id2label") or {0: "LABEL_0"})
            if is_roberta(cfg):  # RobertaClassificationHead: classifier.dense + tanh, classifier.out_proj
                self.classifier = nn.Module()
                self.classifier.dense = Linear(h, h, bias=True)
                self.classifier.out_proj = Linear(h, labels, bias=True)
            else:  # BertForSequenceClassification: pooler (dense + tanh), classifier
                self.pooler = nn.Module()
                self.pooler.dense = Linear(h, h, bias=True)
                self.classifier = Linear(h, labels, bias=True)

    def score(self, cls_states: torch.Tensor) -> torch.Tensor:
        """[B, hidden] fp32 [CLS] (<s>) states -> [B, num_labels] fp32 logits (pergola.outputs.heads activates them)."""
        dense, out = ((self.classifier.dense, self.classifier.out_proj) if is_roberta(self.config)
                      else (self.pooler.dense, self.classifier))
        return out(torch.tanh(dense(cls_states.to(dense.weight.dtype)))).float()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, restarting at 0 for every sequence
        token_types: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,  # [B]: return only these rows' states (Model.takes_rows)
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_types)
        last = len(self.encoder.layer) - 1
        for i, layer in enumerate(self.encoder.layer):
            x = layer(x, meta, attn, rows if i == last else None)
        return x

    def takes_rows(self, pooling: str) -> bool:
        return True  # bidirectional: any row sees its whole sequence
