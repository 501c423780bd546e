#!/usr/bin/env python3
"""Build an offline bundle of vLLM 0.22.0 (the seeds' baseline) for the air-gapped GPU host.

Usage (on a machine with PyPI access):  python3 scripts/vllm_bundle.py
Writes .bundle/vllm_part1..N (each at most 45 MB; downloads and the packed vLLM are cached in
.cache/vllm_bundle/: the first run takes about 12 minutes on 2 cores, almost all of it xz -9,
later runs seconds). Carry one part at a time to the GPU host and run, from the repository root there:
    bash scripts/vllm_setup.sh .bundle/vllm_partN      # idempotent, any order; the last one installs
    python perf/bench_vllm.py --out perf/out/vllm.json  # finds /tmp/vllm-site by itself
(or `source /tmp/vllm-site/env.sh` in a shell that should import vllm).

What goes in, as verified on the GPU host (shared DESIGN.md, "vLLM 0.22.0, the seeds' baseline"):
the vllm wheel's content without vllm/vllm-rs, the FA2 kernels (Hopper runs FA3),
third_party/deep_gemm and the offline-docs static files, packed with xz and split into chunks across
parts; the dependency wheels the host lacks (cp312 manylinux, installed without their own
dependencies; xgrammar without its static library and debug info, 44.6 -> 1.0 MB); and a few small
wheels that only the OpenAI-compatible server imports, installed only where the host has none; and
the Qwen3 tokenizer, so that the benchmark can build its model folders without pergola's own bundle.
The host's torch 2.11.0+cu130 is vLLM's pin.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_common import (  # noqa: E402 - the same downloads and packing into parts as pergola's own bundle
    BUNDLE,
    MB,
    REPO,
    Item,
    add_part_size_option,
    build_qwen3_tokenizer,
    download_wheel,
    log,
    norm_name,
    part_limit,
    report_parts,
    sha256_file,
    split_into_parts,
)

CACHE = REPO / ".cache" / "vllm_bundle"
FORMAT = "pergola-vllm-bundle 1"
PART_PREFIX = "vllm_part"

# The GPU host runs Ubuntu 24.04 (glibc 2.39). pip does not widen a PEP 600 tag to older glibc
# versions, so every one is listed (llguidance 1.7.6, for one, ships manylinux_2_31 only).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + ["manylinux2014_x86_64"]

VLLM = "vllm==0.22.0"
# Paths dropped from the wheel (prefixes): a Rust frontend binary, the FA2 kernels (Hopper runs
# FA3), DeepGEMM (FP8 MoE), and the Swagger files of --enable-offline-docs.
VLLM_DROP = (
    "vllm/vllm-rs",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/third_party/deep_gemm/",
    "vllm/entrypoints/serve/instrumentator/static/",
)
VLLM_TAR_VERSION = 1  # bump when VLLM_DROP or the tar layout changes (invalidates the cache)

# Always installed into the vLLM site: the set that ran on the GPU host, with the four older pins
# (openai, xgrammar, fastapi + starlette) whose newest releases break vLLM 0.22.0 there.
DEPS = [
    "annotated_types==0.8.0", "apache_tvm_ffi==0.1.9", "astor==0.8.1", "blake3==1.0.11",
    "cachetools==8.0.2", "cbor2==6.3.0", "compressed_tensors==0.15.0.1", "depyf==0.20.0", "dill==0.4.1",
    "diskcache==5.6.3", "distro==1.9.0", "flashinfer_python==0.6.11.post2", "gguf==0.19.0", "ijson==3.6.0",
    "interegular==0.3.3", "jiter==0.19.0", "jsonschema==4.26.0", "jsonschema_specifications==2025.9.1",
    "lark==1.2.2", "llguidance==1.7.6", "lm_format_enforcer==0.11.3", "mistral_common==1.13.1",
    "msgspec==0.23.0", "openai_harmony==0.0.8", "outlines_core==0.2.14", "partial_json_parser==0.2.1.1.post7",
    "prometheus_fastapi_instrumentator==8.1.0", "pybase64==1.5.1", "pycountry==26.2.16", "pydantic==2.14.4",
    "pydantic_core==2.50.5", "pydantic_extra_types==2.11.1", "python_json_logger==4.2.0", "pyzmq==27.3.0",
    "referencing==0.37.0", "rpds_py==2026.9.1", "setproctitle==1.3.8", "sniffio==1.3.1",
    "typing_inspection==0.4.5", "watchfiles==1.3.0",
    "openai==2.54.0", "xgrammar==0.2.0", "fastapi==0.121.0", "starlette==0.49.1",
]
# Wheels rewritten smaller, file content otherwise untouched: xgrammar 0.2.0's manylinux wheel is
# 44 MB because it carries a static library for C++ users (65 MB) and its Python extension with
# debug info (53 MB, 3 MB without: `strip --strip-debug` keeps the symbol table).
SLIM = {"xgrammar": {"drop": ("xgrammar/lib/",), "strip_debug": (".so",)}}
SLIM_VERSION = 1  # bump when SLIM changes (invalidates the cache)

# Imported at module level on the OpenAI server's path only (the in-process LLM ran without them):
# installed only when the host's Python does not already satisfy the spec. The GPU image's package
# list (the device notes' KINDS.md) lacks the first, fourth and fifth; the rest are insurance.
SERVER_DEPS = [
    ("uvicorn==0.55.0", "uvicorn>=0.30"),
    ("h11==0.16.0", "h11>=0.8"),
    ("click==8.5.1", "click>=7.0"),
    ("model_hosting_container_standards==0.1.16", "model-hosting-container-standards>=0.1.14,<1.0"),
    ("jmespath==1.0.1", "jmespath"),
    ("tiktoken==0.14.0", "tiktoken>=0.6.0"),  # mistral_common's tokenizers, imported by the server's tool parsers
    ("nvidia_ml_py==13.615.71", "nvidia-ml-py"),  # pynvml, which flashinfer imports
]


def download(req: str, py: str) -> Path:
    """One wheel of `req` for CPython `py` on manylinux x86_64 (no dependencies), cached."""
    return download_wheel(req, CACHE / "dl", py, PLATFORMS)


def slim_wheel(whl: Path) -> Path:
    """`whl` without SLIM's dropped files and with debug info stripped from its libraries (cached).
    The setup script unzips wheels, so the stale RECORD does not matter."""
    rule = SLIM.get(norm_name(whl.name.split("-")[0]))
    if rule is None:
        return whl
    out = CACHE / "slim" / f"v{SLIM_VERSION}" / whl.name
    if out.is_file():
        return out
    if not shutil.which("strip"):
        log(f"  {whl.name}: no `strip` here (binutils), kept whole")
        return whl
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / "strip.tmp"
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out.with_suffix(".partial"), "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(rule["drop"]):
                continue
            data = src.read(info)
            if info.filename.endswith(rule["strip_debug"]) and data[:4] == b"\x7fELF":
                tmp.write_bytes(data)
                subprocess.run(["strip", "--strip-debug", str(tmp)], check=True)
                data = tmp.read_bytes()
                tmp.unlink()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    out.with_suffix(".partial").rename(out)
    log(f"  {whl.name}: {whl.stat().st_size / MB:.1f} MB -> {out.stat().st_size / MB:.1f} MB (slimmed)")
    return out


class _Progress:
    """Counts bytes read through wrapped files and logs every 30 s (xz -9 runs at about 1 MB/s)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0, self.last = total, 0, time.time(), time.time()

    def wrap(self, f: BinaryIO) -> BinaryIO:
        outer = self

        class Reader:
            def read(self, n: int = -1) -> bytes:
                data = f.read(n)
                outer.done += len(data)
                if time.time() - outer.last > 30:
                    outer.last = time.time()
                    rate = outer.done / (outer.last - outer.t0)
                    log(f"    {outer.done / outer.total:4.0%} after {outer.last - outer.t0:.0f} s "
                        f"(about {(outer.total - outer.done) / max(rate, 1):.0f} s left)")
                return data

        return Reader()  # type: ignore[return-value]


def build_vllm_tar(whl: Path) -> Path:
    """tar.xz of the wheel's files (package + dist-info) without VLLM_DROP, unpacked as-is into a site dir."""
    out = CACHE / f"vllm-{sha256_file(whl)[:16]}-v{VLLM_TAR_VERSION}.tar.xz"
    if out.is_file():
        log(f"  {out.name}: cached ({out.stat().st_size / MB:.1f} MB)")
        return out
    buf = out.with_suffix(".partial")
    with zipfile.ZipFile(whl) as z:
        infos = [i for i in z.infolist() if not i.filename.endswith("/")]
        keep = [i for i in infos if not i.filename.startswith(VLLM_DROP)]
        dropped = sum(i.file_size for i in infos) - sum(i.file_size for i in keep)
        total = sum(i.file_size for i in keep)
        log(f"  packing {len(keep)} files ({total / MB:.0f} MB; dropped {dropped / MB:.0f} MB) with xz -9, "
            "single-threaded: several minutes on a small machine")
        progress = _Progress(total)
        with tarfile.open(buf, "w:xz", preset=9) as tar:
            for info in sorted(keep, key=lambda i: i.filename):
                mode = (info.external_attr >> 16) & 0o777 or 0o644
                t = tarfile.TarInfo(info.filename)
                t.size, t.mtime, t.uid, t.gid, t.uname, t.gname = info.file_size, 1700000000, 0, 0, "root", "root"
                t.mode = 0o755 if mode & 0o111 or info.filename.endswith(".so") else 0o644
                with z.open(info) as src:
                    tar.addfile(t, progress.wrap(src))
    buf.rename(out)
    t0 = progress.t0
    log(f"  {out.name}: {out.stat().st_size / MB:.1f} MB in {time.time() - t0:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_part_size_option(ap)
    ap.add_argument("--python", default="3.12", help="the GPU host's Python (3.12); another only for local tests")
    ap.add_argument("--out-dir", default=str(BUNDLE), help="where the parts go (default .bundle/)")
    args = ap.parse_args()
    limit = part_limit(args.part_mb)

    log(f"[1/3] downloading for CPython {args.python} (cached in {CACHE.relative_to(REPO)}/dl)")
    vllm_whl = download(VLLM, args.python)
    wheels = []
    for i, req in enumerate(DEPS, 1):
        wheels.append((slim_wheel(download(req, args.python)), "site"))
        if i % 10 == 0:
            log(f"  {i}/{len(DEPS)} dependency wheels")
    for req, spec in SERVER_DEPS:
        wheels.append((download(req, args.python), f"if:{spec.replace(' ', '')}"))
    deps_mb = sum(w.stat().st_size for w, _ in wheels) / MB
    log(f"  {len(wheels)} wheels, {deps_mb:.1f} MB")

    log("[2/3] packing vLLM")
    vllm_tar = build_vllm_tar(vllm_whl)

    log("[3/3] splitting into parts")
    items = [Item(f"wheels/{w.name}", w, f"wheel {where} {{file}}") for w, where in wheels]
    # The Qwen3 tokenizer (1.4 MB), from which perf/bench_vllm.py builds the seeded model folders:
    # the vLLM baseline then needs none of pergola's own bundle on the GPU host.
    items.append(Item("tokenizer-qwen3.tar.xz", build_qwen3_tokenizer(), "cache {file}"))
    dirs = split_into_parts(items, [(vllm_tar, "vllm.tar.xz")], limit, Path(args.out_dir), PART_PREFIX, FORMAT)
    shown = Path(args.out_dir).resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    log(f"\nwrote {len(dirs)} parts into {shown}/ (limit {limit / MB:.0f} MB each; "
        f"vLLM {vllm_tar.stat().st_size / MB:.1f} MB + wheels {deps_mb:.1f} MB):")

    def contents(d: Path) -> str:
        lines = (d / "MANIFEST").read_text().splitlines()[2:]
        chunks = [ln.split()[2] + "/" + ln.split()[3] for ln in lines if ln.startswith("chunk ")]
        return f"{sum(ln.startswith('wheel ') for ln in lines)} wheels" + (
            f", vllm.tar.xz piece {', '.join(chunks)}" if chunks else "")

    report_parts(dirs, "scripts/vllm_setup.sh",
                 "python perf/bench_vllm.py --out perf/out/vllm.json   (or: source /tmp/vllm-site/env.sh)", contents)


if __name__ == "__main__":
    main()
