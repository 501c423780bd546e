"""The offline vLLM bundles (scripts/vllm_bundle.py, scripts/vllm_setup.sh): 0.22.0, the seeds' baseline, where
it always was, and 0.25.0 beside it in its own site; setup from tiny fake parts into a temporary site."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "vllm_setup.sh"


def _bundle_module():
    spec = importlib.util.spec_from_file_location("vllm_bundle", REPO / "scripts" / "vllm_bundle.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


vb = _bundle_module()
import bundle_common as bc  # noqa: E402 - on the path once vllm_bundle.py is loaded


def _pins(release) -> dict[str, str]:
    reqs = list(release.deps) + [req for req, _ in release.server_deps]
    pins = {vb.norm_name(r.split("==")[0]): r.split("==")[1] for r in reqs}
    assert len(pins) == len(reqs), "a package pinned twice"
    assert all("==" in r for r in reqs), "every wheel pinned to one version"
    return pins


def test_the_default_is_the_seeds_baseline_where_it_always_was():
    r = vb.RELEASES[vb.DEFAULT_VERSION]
    assert (r.version, r.part_prefix, r.site) == ("0.22.0", "vllm_part", "/tmp/vllm-site")
    pins = _pins(r)
    # the four older pins that ran on the GPU host, and FlashInfer's
    assert (pins["openai"], pins["xgrammar"], pins["fastapi"], pins["starlette"]) == ("2.54.0", "0.2.0", "0.121.0",
                                                                                      "0.49.1")
    assert pins["flashinfer-python"] == "0.6.11.post2" and len(r.deps) == 44
    assert r.drop == ("vllm/vllm-rs", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/third_party/deep_gemm/",
                      "vllm/entrypoints/serve/instrumentator/static/")


def test_vllm_025_meets_its_requirements_and_lives_apart():
    r = vb.RELEASES["0.25.0"]
    base = vb.RELEASES["0.22.0"]
    assert (r.part_prefix, r.site) == ("vllm0250_part", "/tmp/vllm-site-0.25.0")
    # write_parts removes <prefix>* first: neither bundle's prefix may match the other's parts
    assert not r.part_prefix.startswith(base.part_prefix) and not base.part_prefix.startswith(r.part_prefix)
    pins = _pins(r)
    v = lambda name: tuple(int(x) for x in pins[name].split(".")[:3])  # noqa: E731
    assert pins["flashinfer-python"] == "0.6.13" and pins["compressed-tensors"] == "0.17.0"
    assert (0, 133) <= v("fastapi")[:2] < (0, 137) and v("starlette") >= (1, 0, 1) and v("xgrammar") >= (0, 2, 1)
    assert v("openai") >= (2, 0, 0)
    for left_out in ("torch", "transformers", "torchcodec", "flashinfer-cubin", "gguf"):
        assert left_out not in pins
    assert set(base.drop) < set(r.drop)


def test_listing_names_version_parts_and_site():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_bundle.py"), "--version", "0.25.0", "--list"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "vLLM 0.25.0: parts vllm0250_part1..N, installed into /tmp/vllm-site-0.25.0" in out
    assert "site  flashinfer_python==0.6.13" in out and "vllm/third_party/fmha_sm100/" in out
    default = subprocess.run([sys.executable, str(REPO / "scripts" / "vllm_bundle.py"), "--list"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    assert default.startswith("vLLM 0.22.0: parts vllm_part1..N, installed into /tmp/vllm-site\n")


def _fake_vllm_tar(path: Path, version: str) -> None:
    """A vllm package with the entry points the setup's check imports, and 200 kB that xz cannot shrink
    (so that it is split across parts)."""
    files = {"vllm/__init__.py": f"__version__ = {version!r}\n", "vllm/entrypoints/__init__.py": "",
             "vllm/entrypoints/llm.py": "", "vllm/entrypoints/openai/__init__.py": "",
             "vllm/entrypoints/openai/api_server.py": "",
             f"vllm-{version}.dist-info/METADATA": f"Name: vllm\nVersion: {version}\n"}
    with tarfile.open(path, "w:xz") as tar:
        for name, text in files.items():
            bc.add_to_tar(tar, name, text.encode(), 0o644)
        bc.add_to_tar(tar, "vllm/blob.bin", random.Random(0).randbytes(200_000), 0o644)


def _tiny_wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tinydep/__init__.py", "VALUE = 7\n")
        z.writestr("tinydep-1.0.dist-info/METADATA", "Name: tinydep\nVersion: 1.0\n")


def _parts(tmp: Path, version: str, header: bool, site: Path) -> list[Path]:
    _fake_vllm_tar(tmp / "vllm.tar.xz", version)
    _tiny_wheel(tmp / "tinydep-1.0-py3-none-any.whl")
    items = [vb.Item("wheels/tinydep-1.0-py3-none-any.whl", tmp / "tinydep-1.0-py3-none-any.whl", "wheel site {file}")]
    head = (f"vllm {version} {site}",) if header else ()
    return vb.split_into_parts(items, [(tmp / "vllm.tar.xz", "vllm.tar.xz")], 200_000, tmp / "bundle",
                               "vllm0250_part", vb.FORMAT, head)


def _setup(part: Path, work: Path, site: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_GPU_DIR=str(work), VLLM_BASE_PYTHON=sys.executable)
    env.pop("VLLM_SITE", None)
    if site is not None:
        env["VLLM_SITE"] = str(site)
    return subprocess.run(["bash", str(SETUP), str(part)], env=env, capture_output=True, text=True, timeout=300)


def test_setup_installs_the_manifests_version_into_its_site_in_any_order(tmp_path):
    site, work = tmp_path / "vllm-site-0.25.0", tmp_path / "work"
    parts = _parts(tmp_path, "0.25.0", True, site)
    assert len(parts) >= 3
    assert (parts[0] / "MANIFEST").read_text().splitlines()[2] == f"vllm 0.25.0 {site}"
    for part in reversed(parts[1:]):
        r = _setup(part, work)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "(vLLM 0.25.0)" in r.stdout and "run the other parts" in r.stdout
    last = _setup(parts[0], work)
    assert last.returncode == 0, last.stdout + last.stderr
    assert "import vllm.entrypoints.openai.api_server: ok" in last.stdout
    assert "vllm_setup: vllm 0.25.0 from" in last.stdout and "gguf" not in last.stdout
    assert (site / "tinydep" / "__init__.py").is_file() and (site / "vllm" / "blob.bin").stat().st_size == 200_000
    env_sh = (site / "env.sh").read_text()
    assert f"VLLM_SITE='{site}'" in env_sh and "VLLM_BUNDLE_VERSION='0.25.0'" in env_sh
    again = _setup(parts[1], work)  # idempotent
    assert again.returncode == 0 and "vllm: already unpacked" in again.stdout, again.stdout + again.stderr


def test_setup_refuses_a_site_holding_another_version_and_reads_old_parts_as_022(tmp_path):
    site, work = tmp_path / "site", tmp_path / "work"
    parts = _parts(tmp_path, "0.24.0", False, site)  # a part without the `vllm` line: 0.22.0's format
    assert all(not ln.startswith("vllm ") for ln in (parts[0] / "MANIFEST").read_text().splitlines())
    results = [_setup(part, work, site) for part in parts]
    assert all("(vLLM 0.22.0)" in r.stdout for r in results)
    assert results[-1].returncode == 1, results[-1].stdout
    assert "the MANIFEST says vLLM 0.22.0" in results[-1].stdout and "holds 0.24.0" in results[-1].stdout
