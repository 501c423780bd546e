"""Hub model ids (pergola.config.hub) from a Hugging Face cache laid out as huggingface_hub lays it out,
offline (HF_HUB_OFFLINE=1): ids, revisions, NAME=ID, what is missing. `pergola serve --model
ORG/NAME` answering from such a cache is tested in test_metrics_server.py (one server for both)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from pergola import cli
from pergola.config.hub import ALLOW_PATTERNS, HubError, download, parse_model_id, resolve

REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
MAIN = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"  # commit ids: 40 hex digits, as the Hub's
TAGGED = "8b3219a92973c328a8e22fadcfa821b5dc75636a"


def add_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 leave_out: tuple[str, ...] = ()) -> Path:
    """models--ORG--NAME/{blobs/<sha256>, refs/<ref> (the commit), snapshots/<commit>/<file> -> blob}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = src.relative_to(folder)
        if str(rel) in leave_out:
            continue
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        if not blob.exists():
            try:
                os.link(src, blob)  # (the 90 MB weights: no copy where the file system allows)
            except OSError:
                shutil.copyfile(src, blob)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, minilm_folder: Path) -> Path:
    """An offline cache holding REPO_ID at main and at tag v1 (huggingface_hub reads its settings at
    import, so the constants are set along with the environment)."""
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    add_snapshot(root, REPO_ID, minilm_folder, MAIN)
    add_snapshot(root, REPO_ID, minilm_folder, TAGGED, refs=("v1",))
    for name, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(root))):
        monkeypatch.setenv(name, "1" if value is True else value)
        monkeypatch.setattr(constants, name, value)
    return root


def test_ids_and_folders_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert parse_model_id("BAAI/bge-m3") == ("BAAI/bge-m3", None)
    assert parse_model_id("Qwen/Qwen3-Embedding-0.6B@refs/pr/3") == ("Qwen/Qwen3-Embedding-0.6B", "refs/pr/3")
    assert parse_model_id("/models/minilm") is None and parse_model_id("a/b/c") is None
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model_id("org/name") is None  # an existing folder stays a folder


def test_an_id_resolves_to_its_snapshot_at_main(cache: Path):
    source = resolve(REPO_ID)
    assert source.folder == cache / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / MAIN
    assert (source.repo_id, source.revision, source.name) == (REPO_ID, MAIN, "all-MiniLM-L6-v2")
    assert source.settings() == {"model_id": REPO_ID, "model_revision": MAIN}


@pytest.mark.parametrize("revision", ["v1", TAGGED])
def test_a_revision_picks_its_snapshot(cache: Path, revision: str):
    source = resolve(f"{REPO_ID}@{revision}")
    assert source.revision == TAGGED and source.folder.name == TAGGED


def test_a_local_folder_is_unchanged(cache: Path, minilm_folder: Path):
    source = resolve(str(minilm_folder))
    assert source.folder == minilm_folder.resolve() and source.repo_id is None and source.settings() == {}


def test_an_id_missing_from_the_cache_offline_names_the_cache(cache: Path):
    with pytest.raises(HubError) as e:
        resolve("BAAI/bge-m3")
    message = str(e.value)
    assert str(cache) in message and "HF_HUB_OFFLINE=1" in message and "pergola download BAAI/bge-m3" in message
    with pytest.raises(HubError, match="v9"):
        resolve(f"{REPO_ID}@v9")
    with pytest.raises(HubError, match=f"{'0' * 40} is not a folder here.*pergola download"):
        resolve(f"{REPO_ID}@{'0' * 40}")  # a commit the cache lacks


@pytest.mark.parametrize("left_out, named", [("tokenizer.json", "tokenizer.json"),
                                             ("model.safetensors", "safetensors")])
def test_a_snapshot_without_a_needed_file_is_refused_by_name(cache: Path, minilm_folder: Path, left_out: str,
                                                             named: str):
    add_snapshot(cache, "org/partial", minilm_folder, MAIN, leave_out=(left_out,))
    with pytest.raises(HubError, match=f"has no .*{named}.*pergola download org/partial"):
        resolve("org/partial")


def test_download_refuses_what_is_not_an_id_and_fetches_from_the_cache(cache: Path, minilm_folder: Path, capsys):
    with pytest.raises(HubError, match="not a Hugging Face model id"):
        download(str(minilm_folder))
    assert download(f"{REPO_ID}@v1").revision == TAGGED
    cli.main(["download", REPO_ID, f"{REPO_ID}@v1"])  # what an image build runs
    assert capsys.readouterr().out.splitlines() == [
        f"{REPO_ID}@{commit}: {cache / 'models--sentence-transformers--all-MiniLM-L6-v2' / 'snapshots' / commit}"
        for commit in (MAIN, TAGGED)]
    with pytest.raises(SystemExit, match="pergola download: org/absent is not a folder here"):
        cli.main(["download", "org/absent"])


def test_allow_patterns_take_what_pergola_reads_and_nothing_else():
    from huggingface_hub.utils import filter_repo_objects

    files = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "modules.json",
             "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
             "2_Dense/config.json", "2_Dense/model.safetensors",
             "pytorch_model.bin", "onnx/model.onnx", "openvino/openvino_model.bin", "README.md",
             "2_Dense/pytorch_model.bin", "tf_model.h5"]
    kept = set(filter_repo_objects(files, allow_patterns=ALLOW_PATTERNS))
    assert kept == set(files[:13])


def test_build_repo_records_the_id_and_revision(cache: Path, tmp_path: Path):
    repo = tmp_path / "repo"
    cli.main(["build-repo", "--device", "cpu", "--repo", str(repo), "--model", REPO_ID,
              "--model", f"tagged={REPO_ID}@v1"])
    for name, commit in (("all-MiniLM-L6-v2", MAIN), ("tagged", TAGGED)):
        config = (repo / f"{name}_encoder" / "config.pbtxt").read_text()
        assert f'key: "model_revision" value: {{ string_value: "{commit}" }}' in config
        assert f'key: "model_id" value: {{ string_value: "{REPO_ID}" }}' in config
        assert (repo / f"{name}_encoder" / "1" / "hf").resolve().name == commit
    with pytest.raises(SystemExit, match="pergola build-repo: org/absent is not a folder here, nor in"):
        cli.main(["build-repo", "--device", "cpu", "--repo", str(tmp_path / "r2"), "--model", "org/absent"])
