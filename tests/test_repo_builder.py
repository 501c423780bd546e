"""Where encoder instances go: the generated configs, read back with Triton's own protobuf schema
(a CPU machine cannot load a KIND_GPU model, so the placement is checked in the config text)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from pergola.triton.repo_builder import build_repository, entry_from_folder
from tritonclient.grpc import model_config_pb2


def encoder_groups(repo: Path, name: str) -> list[model_config_pb2.ModelInstanceGroup]:
    config = text_format.Parse((repo / f"{name}_encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return list(config.instance_group)


@pytest.fixture(scope="module")
def entries(minilm_folder, rerank_folders):
    return [entry_from_folder(minilm_folder, "mini"), entry_from_folder(rerank_folders["cross-encoder"], "ce")]


@pytest.mark.parametrize("gpu, gpus, kind, listed", [
    (False, None, model_config_pb2.ModelInstanceGroup.KIND_CPU, []),
    (True, None, model_config_pb2.ModelInstanceGroup.KIND_GPU, []),  # Triton: one on every GPU it sees
    (True, [0, 2], model_config_pb2.ModelInstanceGroup.KIND_GPU, [0, 2]),
])
def test_one_encoder_instance_per_gpu_listed_or_seen(tmp_path, entries, gpu, gpus, kind, listed):
    repo = build_repository(tmp_path / "repo", entries, gpu=gpu, gpus=gpus)
    for name in ("mini", "ce"):
        (group,) = encoder_groups(repo, name)
        assert (group.kind, group.count, list(group.gpus)) == (kind, 1, listed)


@pytest.mark.parametrize("gpu, gpus, message", [
    (False, [0], "needs encoder instances on the GPU"),
    (True, [0, 0], "distinct device numbers"),
    (True, [-1], "distinct device numbers"),
])
def test_a_bad_gpu_list_is_refused_before_anything_is_removed(tmp_path, entries, gpu, gpus, message):
    repo = build_repository(tmp_path / "repo", entries, gpu=False)
    with pytest.raises(ValueError, match=message):
        build_repository(repo, entries, gpu=gpu, gpus=gpus)
    assert (repo / "mini_encoder" / "config.pbtxt").is_file()


def test_the_cli_names_the_option(tmp_path, minilm_folder):
    run = subprocess.run([sys.executable, "-m", "pergola.cli", "build-repo", "--repo", str(tmp_path / "r"),
                          "--model", f"mini={minilm_folder}", "--device", "cpu", "--gpus", "0,x"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--gpus takes GPU numbers" in run.stderr, run.stderr


def encoder_queue(repo: Path, name: str) -> model_config_pb2.ModelQueuePolicy:
    config = text_format.Parse((repo / f"{name}_encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return config.dynamic_batching.default_queue_policy


@pytest.mark.parametrize("settings, policy", [
    ({}, False),
    ({"max_queue_size": 8}, True),
    ({"queue_timeout_ms": 500}, True),
])
def test_the_encoder_queue_has_no_policy_unless_asked(tmp_path, minilm_folder, rerank_folders, settings, policy):
    """Triton 2.51's dynamic batcher prefetches the next batch while execute() runs only when the
    queue has no policy (scheduler_utils.cc: max_queue_size 0, default timeout 0, no override).
    Without prefetching, a request that arrives during an execute() waits for the batcher's 500 ms
    idle timeout (perf/results/2026-12-05-2888e8b-cpu/NOTES.md), none with the default below."""
    entries = [entry_from_folder(minilm_folder, "mini", **settings),
               entry_from_folder(rerank_folders["cross-encoder"], "ce", **settings)]
    repo = build_repository(tmp_path / "repo", entries, gpu=False)
    for name in ("mini", "ce"):
        queue = encoder_queue(repo, name)
        prefetches = (queue.max_queue_size == 0 and queue.default_timeout_microseconds == 0
                      and not queue.allow_timeout_override)
        assert prefetches != policy, queue
