"""Which kind of reranker a folder holds and the answer tokens a yes/no reranker is scored on:
what the loader (pergola.models.loader: the LM head rows it keeps) and the request tokenization
(pergola.text.rerank: the prompt it lays pairs out in) both read from the folder."""

from __future__ import annotations

from typing import Literal, NamedTuple

from tokenizers import Tokenizer

from pergola.config.hf_folder import ModelFolderError, ModelSpec, sequence_classification

RerankKind = Literal["cross-encoder", "qwen3-reranker", "mxbai-rerank-v2"]
RERANK_KINDS: tuple[str, ...] = ("cross-encoder", "qwen3-reranker", "mxbai-rerank-v2")
# The prompts whose score is read from two answer tokens' logits: their (no, yes) words.
ANSWER_WORDS: dict[str, tuple[str, str]] = {"qwen3-reranker": ("no", "yes"), "mxbai-rerank-v2": ("0", "1")}


def reranker_kind(spec: ModelSpec) -> RerankKind:
    """How a folder's pairs are laid out: "cross-encoder" (the tokenizer's pair template: BERT,
    XLM-RoBERTa, ModernBERT, and decoder ForSequenceClassification heads), or a yes/no prompt of a
    causal LM ("qwen3-reranker" for Qwen3, "mxbai-rerank-v2" for Qwen2, or as its
    sentence-transformers LogitScore tokens say). `spec.rerank_prompt` overrides it."""
    if spec.task != "rerank":
        raise ValueError(f"{spec.path} is served as {spec.task!r}, not as a reranker")
    if spec.rerank_prompt is not None:
        return spec.rerank_prompt  # type: ignore[return-value]
    if spec.architecture != "qwen3" or sequence_classification(spec.hf_config):
        return "cross-encoder"
    if spec.answer_token_ids is not None:  # a sentence-transformers LogitScore module names the tokens
        tokenizer = Tokenizer.from_file(str(spec.tokenizer_file))
        words = tuple(tokenizer.id_to_token(i) for i in spec.answer_token_ids)
        for kind, answer in ANSWER_WORDS.items():
            if words == answer:
                return kind  # type: ignore[return-value]
        raise ModelFolderError(f"{spec.path}: the LogitScore module scores the tokens {words} (no, yes); pergola "
                               f"serves the prompts of {dict(ANSWER_WORDS)}")
    return "mxbai-rerank-v2" if spec.hf_config.get("model_type") == "qwen2" else "qwen3-reranker"


def yes_no_head(spec: ModelSpec) -> bool:
    """The score is read from two rows of the LM head (a causal LM reranker), not a `score` layer."""
    return spec.task == "rerank" and spec.architecture == "qwen3" and not sequence_classification(spec.hf_config)


class AnswerIds(NamedTuple):
    """Token ids of a yes/no reranker's answer words: its score is softmax([no, yes] logits)[yes]."""

    no: int
    yes: int


def answer_ids(spec: ModelSpec, tokenizer: Tokenizer | None = None, kind: str | None = None) -> AnswerIds:
    """The ids of the answer words ("no"/"yes", "0"/"1") of prompt `kind` (default: the folder's)
    in the folder's tokenizer (`tokenizer`: that file, already loaded), or those its
    sentence-transformers LogitScore module names."""
    if spec.answer_token_ids is not None:
        return AnswerIds(*spec.answer_token_ids)
    kind = kind or reranker_kind(spec)
    if kind not in ANSWER_WORDS:
        raise ModelFolderError(f"{spec.path}: a causal LM reranker needs a yes/no prompt "
                               f"({', '.join(ANSWER_WORDS)}), not {kind!r}")
    tokenizer = tokenizer or Tokenizer.from_file(str(spec.tokenizer_file))
    words = ANSWER_WORDS[kind]
    no, yes = (tokenizer.token_to_id(w) for w in words)
    if no is None or yes is None:
        raise ModelFolderError(f"{spec.path}: the tokenizer has no {words[1]!r}/{words[0]!r} tokens; "
                               f"is this a {kind} reranker?")
    return AnswerIds(int(no), int(yes))
