#!/usr/bin/env python3
"""Build an offline bundle of vLLM 0.22.0 (the seeds' baseline) or 0.25.0 for the air-gapped GPU host.

Usage (on a machine with PyPI access):  python3 scripts/vllm_bundle.py [--version 0.25.0] [--list]
Writes .bundle/vllm_part1..N (0.25.0: .bundle/vllm0250_part1..N; each at most 45 MB; downloads and the packed
vLLM are cached in .cache/vllm_bundle/: the first run takes 4-12 minutes on 2 cores, almost all of it xz -9,
later runs seconds). Carry one part at a time to the GPU host and run, from the repository root there:
    bash scripts/vllm_setup.sh .bundle/vllm_partN      # idempotent, any order; the last one installs
    python perf/bench_vllm.py --out perf/out/vllm.json  # finds /tmp/vllm-site by itself
(or `source /tmp/vllm-site/env.sh` in a shell that should import vllm). 0.25.0's parts install into
/tmp/vllm-site-0.25.0 (their MANIFEST says so): perf/bench_vllm.py --vllm-site /tmp/vllm-site-0.25.0.

What goes in, as verified on the GPU host for 0.22.0 (shared DESIGN.md, "vLLM 0.22.0, the seeds' baseline"):
the vllm wheel's content without vllm/vllm-rs, the FA2 kernels (Hopper runs FA3),
third_party/deep_gemm and the offline-docs static files, packed with xz and split into chunks across
parts; the dependency wheels the host lacks (cp312 manylinux, installed without their own
dependencies; xgrammar without its static library and debug info, 44.6 -> 1.0 MB); and a few small
wheels that only the OpenAI-compatible server imports, installed only where the host has none; and
the Qwen3 tokenizer, so that the benchmark can build its model folders without pergola's own bundle.
The host's torch 2.11.0+cu130 is the pin of both releases. RELEASES says how 0.25.0's set differs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
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

# The GPU host runs Ubuntu 24.04 (glibc 2.39). pip does not widen a PEP 600 tag to older glibc
# versions, so every one is listed (llguidance 1.7.6, for one, ships manylinux_2_31 only).
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + ["manylinux2014_x86_64"]


@dataclass(frozen=True)
class Release:
    """What one vLLM release's bundle carries. scripts/vllm_setup.sh installs 0.22.0 into /tmp/vllm-site
    and any other into /tmp/vllm-site-VERSION (the MANIFEST's `vllm VERSION` line says which)."""

    version: str
    part_prefix: str  # .bundle/<prefix>N
    drop: tuple[str, ...]  # paths dropped from the wheel (prefixes)
    tar_version: int  # bump when `drop` or the tar layout changes (invalidates the cache)
    deps: list[str]  # always installed into the vLLM site
    server_deps: list[tuple[str, str]]  # (wheel, spec): installed only where the host's Python lacks spec

    @property
    def site(self) -> str:
        """Where scripts/vllm_setup.sh installs it on the GPU host (0.22.0 where it always was)."""
        return "/tmp/vllm-site" if self.version == "0.22.0" else f"/tmp/vllm-site-{self.version}"


# Dropped from every wheel: a Rust frontend binary, the FA2 kernels (Hopper runs FA3), DeepGEMM (FP8
# MoE), and the Swagger files of --enable-offline-docs.
_DROP = (
    "vllm/vllm-rs",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/third_party/deep_gemm/",
    "vllm/entrypoints/serve/instrumentator/static/",
)

# Imported at module level on the OpenAI server's path only (the in-process LLM ran without them):
# installed only when the host's Python does not already satisfy the spec. The GPU image's package
# list (the device notes' KINDS.md) lacks the first, fourth and fifth; the rest are insurance.
_SERVER_DEPS = [
    ("uvicorn==0.55.0", "uvicorn>=0.30"),
    ("h11==0.16.0", "h11>=0.8"),
    ("click==8.5.1", "click>=7.0"),
    ("model_hosting_container_standards==0.1.16", "model-hosting-container-standards>=0.1.14,<1.0"),
    ("jmespath==1.0.1", "jmespath"),
    ("tiktoken==0.14.0", "tiktoken>=0.6.0"),  # mistral_common's tokenizers, imported by the server's tool parsers
    ("nvidia_ml_py==13.615.71", "nvidia-ml-py"),  # pynvml, which flashinfer imports
]

# The seeds' baseline, as it ran on the GPU host (shared DESIGN.md): the set below with the four older
# pins (openai, xgrammar, fastapi + starlette) whose newest releases break vLLM 0.22.0 there.
_DEPS_0220 = [
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


def repinned(deps: list[str], changes: dict[str, str | None]) -> list[str]:
    """`deps` with each package named in `changes` pinned to its new version, or left out where None."""
    out = []
    for req in deps:
        name = req.split("==")[0]
        if name not in changes:
            out.append(req)
        elif changes[name] is not None:
            out.append(f"{name}=={changes[name]}")
    return out


RELEASES = {r.version: r for r in (
    Release("0.22.0", "vllm_part", _DROP, 1, _DEPS_0220, _SERVER_DEPS),
    # The newest release whose torch pin is the host's 2.11.0: 0.22.0's set at the versions pip resolves
    # for 0.25.0's Requires-Dist against the host's transformers 5.17.0 (fastapi < 0.137, starlette >= 1.0.1,
    # xgrammar >= 0.2.1, compressed-tensors 0.17.0, flashinfer 0.6.13), except openai: 3.x imports httpx2,
    # which the host lacks, and 2.54.0 ran there with 0.22.0 (0.25.0 asks >= 2.0). gguf is no longer
    # required. Left out as for 0.22.0: what vLLM imports lazily or behind try (torchcodec, PyNvVideoCodec,
    # nvtx: video and profiling; tilelang, quack, humming, tokenspeed-mla, cutlass-dsl: kernels for other
    # models) and flashinfer-cubin (458 MB of prebuilt kernels; flashinfer JIT-compiles with the host's nvcc
    # instead, and the pooling models run FA3). Also dropped from the wheel: MiniMax-M3's SM100 attention
    # (lazy there).
    Release("0.25.0", "vllm0250_part", _DROP + ("vllm/third_party/fmha_sm100/",), 1, repinned(_DEPS_0220, {
        "cachetools": "8.0.3", "compressed_tensors": "0.17.0", "flashinfer_python": "0.6.13", "gguf": None,
        "xgrammar": "0.2.3", "fastapi": "0.136.3", "starlette": "1.10.0",
    }), _SERVER_DEPS),
)}
DEFAULT_VERSION = "0.22.0"
# Wheels rewritten smaller, file content otherwise untouched: xgrammar 0.2.0's manylinux wheel is
# 44 MB because it carries a static library for C++ users (65 MB) and its Python extension with
# debug info (53 MB, 3 MB without: `strip --strip-debug` keeps the symbol table).
SLIM = {"xgrammar": {"drop": ("xgrammar/lib/",), "strip_debug": (".so",)}}
SLIM_VERSION = 1  # bump when SLIM changes (invalidates the cache)


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


def build_vllm_tar(whl: Path, release: Release) -> Path:
    """tar.xz of the wheel's files (package + dist-info) without `release.drop`, unpacked as-is into a site dir."""
    out = CACHE / f"vllm-{sha256_file(whl)[:16]}-v{release.tar_version}.tar.xz"
    if out.is_file():
        log(f"  {out.name}: cached ({out.stat().st_size / MB:.1f} MB)")
        return out
    buf = out.with_suffix(".partial")
    with zipfile.ZipFile(whl) as z:
        infos = [i for i in z.infolist() if not i.filename.endswith("/")]
        keep = [i for i in infos if not i.filename.startswith(release.drop)]
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


def listing(release: Release) -> str:
    """What the bundle of `release` carries, without downloading anything (--list)."""
    lines = [f"vLLM {release.version}: parts {release.part_prefix}1..N, installed into {release.site}",
             f"  dropped from the wheel: {', '.join(release.drop)}"]
    lines += [f"  site  {req}" for req in release.deps]
    lines += [f"  if the host lacks {spec}: {req}" for req, spec in release.server_deps]
    return "\n".join(lines)


def build(release: Release, py: str, limit: int, out_dir: Path) -> list[Path]:
    """Download, pack and split `release`'s bundle into `out_dir`/<part_prefix>N."""
    log(f"[1/3] downloading for CPython {py} (cached in {CACHE.relative_to(REPO)}/dl)")
    vllm_whl = download(f"vllm=={release.version}", py)
    wheels = []
    for i, req in enumerate(release.deps, 1):
        wheels.append((slim_wheel(download(req, py)), "site"))
        if i % 10 == 0:
            log(f"  {i}/{len(release.deps)} dependency wheels")
    for req, spec in release.server_deps:
        wheels.append((download(req, py), f"if:{spec.replace(' ', '')}"))
    deps_mb = sum(w.stat().st_size for w, _ in wheels) / MB
    log(f"  {len(wheels)} wheels, {deps_mb:.1f} MB")

    log(f"[2/3] packing vLLM {release.version}")
    vllm_tar = build_vllm_tar(vllm_whl, release)

    log("[3/3] splitting into parts")
    items = [Item(f"wheels/{w.name}", w, f"wheel {where} {{file}}") for w, where in wheels]
    # The Qwen3 tokenizer (1.4 MB), from which perf/bench_vllm.py builds the seeded model folders:
    # the vLLM baseline then needs none of pergola's own bundle on the GPU host.
    items.append(Item("tokenizer-qwen3.tar.xz", build_qwen3_tokenizer(), "cache {file}"))
    dirs = split_into_parts(items, [(vllm_tar, "vllm.tar.xz")], limit, out_dir, release.part_prefix, FORMAT,
                            (f"vllm {release.version} {release.site}",))
    shown = out_dir.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
    log(f"\nwrote {len(dirs)} parts into {shown}/ (limit {limit / MB:.0f} MB each; "
        f"vLLM {vllm_tar.stat().st_size / MB:.1f} MB + wheels {deps_mb:.1f} MB):")
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_part_size_option(ap)
    ap.add_argument("--version", default=DEFAULT_VERSION, choices=sorted(RELEASES),
                    help=f"the vLLM release (default {DEFAULT_VERSION}, the seeds' baseline)")
    ap.add_argument("--list", action="store_true", help="print what the bundle carries and stop (no downloads)")
    ap.add_argument("--python", default="3.12", help="the GPU host's Python (3.12); another only for local tests")
    ap.add_argument("--out-dir", default=str(BUNDLE), help="where the parts go (default .bundle/)")
    args = ap.parse_args()
    release = RELEASES[args.version]
    if args.list:
        log(listing(release))
        return
    dirs = build(release, args.python, part_limit(args.part_mb), Path(args.out_dir))

    def contents(d: Path) -> str:
        lines = (d / "MANIFEST").read_text().splitlines()[2:]
        chunks = [ln.split()[2] + "/" + ln.split()[3] for ln in lines if ln.startswith("chunk ")]
        return f"{sum(ln.startswith('wheel ') for ln in lines)} wheels" + (
            f", vllm.tar.xz piece {', '.join(chunks)}" if chunks else "")

    site_flag = "" if release.version == DEFAULT_VERSION else f" --vllm-site {release.site}"
    report_parts(dirs, "scripts/vllm_setup.sh", f"python perf/bench_vllm.py{site_flag} --out perf/out/vllm.json"
                 f"   (or: source {release.site}/env.sh)", contents)


if __name__ == "__main__":
    main()
