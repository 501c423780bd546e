"""The offline GPU bundle (scripts/gpu_bundle.py) carries every runtime dependency the GPU host lacks."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", REPO / "scripts" / "gpu_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


def test_every_runtime_dependency_is_carried_or_said_why_not():
    """A dependency added to pyproject.toml and not to the bundle fails on the GPU host only (the
    Batch API's python-multipart once did: POST /v1/files answered 500 there)."""
    bundle = _bundle_module()
    norm = bundle.norm_name
    deps = {norm(_name(r)) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    carried = {norm(_name(req)) for req, _ in bundle.WHEELS}
    not_carried = {norm(name) for name in bundle.NOT_CARRIED}
    assert not carried & not_carried, "a dependency both carried and said not to be"
    missing = sorted(deps - carried - not_carried)
    assert not missing, f"add to scripts/gpu_bundle.py's WHEELS, or to NOT_CARRIED with the reason: {missing}"
    stale = sorted(not_carried - deps)
    assert not stale, f"NOT_CARRIED names what pyproject.toml no longer needs: {stale}"
