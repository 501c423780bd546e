"""Hugging Face model ids for `--model`: `ORG/NAME[@REVISION]` becomes a folder of the local cache.

A value that names an existing folder is that folder, exactly as before. Anything else of the
form ORG/NAME (optionally @REVISION: a branch, tag or commit) is fetched with huggingface_hub's
`snapshot_download`, which keeps the standard cache layout (`HF_HOME`, `HF_HUB_CACHE`), reads
`HF_TOKEN` for gated and private models, and under `HF_HUB_OFFLINE=1` answers from the cache
alone, so an air-gapped host serves what `pergola download` put there. Only the files pergola
reads are fetched (ALLOW_PATTERNS): safetensors weights, the configs, the tokenizer and the
sentence-transformers modules; never PyTorch .bin, ONNX or OpenVINO copies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt",
    # sentence-transformers: the pipeline, its settings, and its module folders (1_Pooling/, 2_Dense/, ...)
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "[0-9]*_*/*.json", "[0-9]*_*/*.safetensors",
]
# What a snapshot must hold for pergola to serve it (the weights are checked separately).
REQUIRED_FILES = ("config.json", "tokenizer.json")
MODEL_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
COMMIT = re.compile(r"[0-9a-f]{40}")  # a full commit hash: the one revision a cache can answer alone


class HubError(ValueError):
    """A model id that cannot be served; the message says what to change."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are, and which Hub repository and commit they came from."""

    folder: Path
    repo_id: str | None = None  # ORG/NAME, or None for a local folder
    revision: str | None = None  # the commit the snapshot holds

    @property
    def name(self) -> str | None:
        """The served name a Hub model gets unless NAME= says otherwise: NAME of ORG/NAME."""
        return self.repo_id.rsplit("/", 1)[-1] if self.repo_id else None

    def settings(self) -> dict[str, str]:
        """EngineConfig fields that record the source in the model's config.pbtxt (shown by /info)."""
        return {"model_id": self.repo_id, "model_revision": self.revision} if self.repo_id else {}

    @property
    def label(self) -> str:
        """ORG/NAME@COMMIT for a Hub model, the folder otherwise (for logs and errors)."""
        return f"{self.repo_id}@{self.revision}" if self.repo_id else str(self.folder)


def parse_model_id(value: str) -> tuple[str, str | None] | None:
    """(ORG/NAME, REVISION or None) when `value` is a Hub id rather than an existing folder."""
    match = MODEL_ID.fullmatch(value)
    if match is None or Path(value).expanduser().exists():
        return None
    return match["repo"], match["revision"]


def hub_cache_dir() -> Path:
    """The Hugging Face cache huggingface_hub uses here (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve(value: str) -> ModelSource:
    """A `--model` value as a folder: an existing folder as it is, a Hub id through the cache."""
    parsed = parse_model_id(value)
    if parsed is None:
        return ModelSource(Path(value).expanduser().resolve())
    repo_id, revision = parsed
    folder = snapshot(repo_id, revision)
    check_snapshot(folder, value)
    return ModelSource(folder, repo_id, folder.name)


def cached_commit(repo_id: str, revision: str | None) -> Path | None:
    """A pinned commit's snapshot straight from the cache, with no call to the Hub: a commit never
    moves, and huggingface_hub 1.x asks the Hub's API for one even with HF_HUB_OFFLINE=1 (and raises
    OfflineModeIsEnabled; seen on the GPU host's 1.x, not with 2.4)."""
    if revision is None or not COMMIT.fullmatch(revision):
        return None
    folder = hub_cache_dir() / f"models--{repo_id.replace('/', '--')}" / "snapshots" / revision
    return folder if folder.is_dir() else None


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main), downloaded if not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    spec = f"{repo_id}@{revision}" if revision else repo_id
    if (pinned := cached_commit(repo_id, revision)) is not None:
        return pinned
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its terms on the Hub and set HF_TOKEN to a token with "
                       "access") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo_id} is neither a local folder nor a model on the Hub (a private model needs "
                       "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        where = "HF_HUB_OFFLINE=1 is set" if offline() else f"the Hub could not be reached ({e.__cause__ or e})"
        raise HubError(
            f"{spec} is not a folder here, nor in the Hugging Face cache {hub_cache_dir()}, and {where}: fill the cache with "
            f"`pergola download {spec}` where the Hub is reachable, or point HF_HUB_CACHE (or HF_HOME) at "
            "a cache that holds it") from None
    except HfHubHTTPError as e:
        raise HubError(f"{spec}: the Hub answered {e}") from None


def check_snapshot(folder: Path, spec: str) -> None:
    """Refuse a snapshot that lacks what pergola loads, naming the file (a partial copy of a cache,
    or a repository without safetensors weights)."""
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors (pergola loads safetensors weights only)")
    if missing:
        raise HubError(f"{spec}: the snapshot {folder} has no {', '.join(missing)}; download it again with "
                       f"`pergola download {spec}` (offline hosts: copy a complete cache)")


def download(value: str) -> ModelSource:
    """`pergola download ID`: the files pergola serves, into the cache (for images and offline hosts)."""
    if parse_model_id(value) is None:
        raise HubError(f"{value!r} is not a Hugging Face model id (ORG/NAME or ORG/NAME@REVISION)")
    return resolve(value)
