#!/usr/bin/env bash
# Build pergola's image (Dockerfile) with podman or Docker and check that it starts.
#
#   scripts/build_image.sh [TAG] [--cpu] [--base IMAGE] [--prefetch "ORG/NAME ..."] [--push]
#
# Default: the GPU image (NGC tritonserver 24.10 + PyTorch cu126 + FlashInfer), tag
# pergola:<version in pyproject.toml>; it checks torch's CUDA and FlashInfer's prebuilt kernels.
# --cpu: the CPU image (target `cpu`: PyTorch's CPU build, the nvidia-pytriton wheel's tritonserver,
# all-MiniLM-L6-v2), tag pergola:<version>-cpu, on --base (default python:3.11-slim-bookworm;
# scripts/container_base.sh makes one from Debian's archive where no registry is reachable).
# --prefetch bakes public Hub models into the image's Hugging Face cache (GPU image).
#
# pip inside the build uses this host's pip settings (`pip config list`: index, extra indexes,
# find-links, CA bundle): they go in as build secrets, local folders they name are mounted
# read-only (podman), and no layer keeps them. PYTHON names the python whose pip settings count.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
tag=""
target=gpu
base=""
prefetch=""
push=0
while (($#)); do
    case "$1" in
        --cpu) target=cpu; shift ;;
        --base) base="$2"; shift 2 ;;
        --prefetch) prefetch="$2"; shift 2 ;;
        --push) push=1; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        -*) echo "build_image.sh: unknown option $1" >&2; exit 2 ;;
        *) tag="$1"; shift ;;
    esac
done
if [[ $target == cpu ]]; then
    tag=${tag:-pergola:${version}-cpu}
    base=${base:-python:3.11-slim-bookworm}
else
    tag=${tag:-pergola:${version}}
fi

if command -v podman >/dev/null; then
    engine=podman
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
    export DOCKER_BUILDKIT=1  # RUN --mount=type=secret
else
    echo "build_image.sh: neither podman nor a Docker engine here (scripts/container_base.sh installs podman)" >&2
    exit 1
fi

# This host's pip settings -> $settings/pip.conf (+ pip-ca.crt); prints the local folders it names.
settings=$(mktemp -d)
trap 'rm -rf "$settings"' EXIT
python=${PYTHON:-python3}
host_pip_settings() {
    "$python" - "$settings" <<'EOF'
import os, re, shutil, subprocess, sys
from urllib.parse import unquote, urlparse

out = sys.argv[1]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}  # pip's precedence: the environment wins
found: dict[str, dict[int, str]] = {}
for line in listed.splitlines():
    m = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line)
    if m and m[1] in rank:
        found.setdefault(m[2], {})[rank[m[1]]] = m[3]
conf = {key: values[max(values)] for key, values in found.items()}
conf.pop("config-file", None)
ca = conf.pop("cert", None) or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
if ca and os.path.isfile(ca):
    shutil.copyfile(ca, os.path.join(out, "pip-ca.crt"))
    conf["cert"] = "/run/secrets/pip-ca.crt"
folders = set()
for key in ("index-url", "extra-index-url", "find-links", "constraint", "requirement"):
    for item in conf.get(key, "").split():
        path = unquote(urlparse(item).path) if item.startswith("file:") else item
        if os.path.isabs(path) and os.path.exists(path):
            # a file:// simple index links to ../../files: mount the folder above `simple`
            folder = path if os.path.isdir(path) else os.path.dirname(path)
            folders.add(os.path.dirname(folder.rstrip("/")) if folder.rstrip("/").endswith("/simple") else folder)
with open(os.path.join(out, "pip.conf"), "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(conf.items())))
print("\n".join(sorted(folders)))
EOF
}
args=(--target "$target" --build-arg PREFETCH="${prefetch}" -t "$tag")
[[ -n $base ]] && args+=(--build-arg BASE="$base")
folders=$(host_pip_settings)
args+=(--secret "id=pip.conf,src=$settings/pip.conf")
[[ -f $settings/pip-ca.crt ]] && args+=(--secret "id=pip-ca.crt,src=$settings/pip-ca.crt")
limits=()
if [[ $engine == podman ]]; then
    for folder in $folders; do args+=(-v "$folder:$folder:ro"); done
    # Docker's image format keeps SHELL (pipefail). The checks below run with podman's own limits
    # on open files and processes (podman's defaults are above what a host without
    # CAP_SYS_RESOURCE may set; the build's come from containers.conf: scripts/container_base.sh).
    args+=(--format docker)
    limits=(--ulimit host)
elif [[ -n $folders ]]; then
    echo "build_image.sh: pip's local folders ($folders) are not visible to a docker build; using its remote indexes" >&2
fi

start=$(date +%s)
$engine build "${args[@]}" .
built=$(($(date +%s) - start))

if [[ $target == cpu ]]; then
    $engine run --rm "${limits[@]}" "$tag" python -c "
import torch, pergola.cli, pergola.gateway.app, pergola_client
from pergola.triton.server import TritonInstall
install = TritonInstall.prepare()
assert install.binary.is_file(), install.binary
build = 'CPU build' if torch.version.cuda is None else 'CUDA build: no CPU build was reachable'
print('torch', torch.__version__, f'({build}); tritonserver', install.binary)"
else
    $engine run --rm "${limits[@]}" --entrypoint python "$tag" -c "
import shutil, torch, pergola.cli, pergola.gateway.app, pergola.config.hub
assert torch.version.cuda.startswith('12.6'), torch.version.cuda
assert shutil.which('tritonserver') or __import__('os').path.exists('/opt/tritonserver/bin/tritonserver')
print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
    # FlashInfer's prebuilt modules: those the start-up probe asks for (attention.flashinfer_ready)
    $engine run --rm "${limits[@]}" -e FLASHINFER_CUDA_ARCH_LIST=9.0a --entrypoint python "$tag" -c "
import torch
from pergola.layers.flashinfer_modules import prefill_spec
for template in ('fa2', 'fa3'):
    for head_dim in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            spec = prefill_spec(template, head_dim, dtype)
            assert spec.is_compiled, f'FlashInfer module {spec.name} is not prebuilt in the image'
print('FlashInfer: 8 prefill modules prebuilt')"
fi
size=$($engine image inspect "$tag" --format '{{.Size}}')
echo "built $tag with $engine in ${built} s: $((size / 1000000)) MB"
if ((push)); then $engine push "$tag"; fi
