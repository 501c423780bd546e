#!/usr/bin/env bash
# Build the pergola image (Dockerfile: NGC tritonserver 24.10 + PyTorch cu126 + pergola) and check
# that it starts: torch's CUDA is 12.6, pergola and the gateway import, tritonserver is there.
#
#   scripts/build_image.sh [TAG] [--prefetch "ORG/NAME ..."] [--push]
#
# TAG defaults to pergola:<version in pyproject.toml>. --prefetch bakes public Hub models into the
# image's Hugging Face cache (`pergola download`); for gated ones mount a filled cache at run time
# instead, so that no token is needed in the build. Needs a Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
tag="pergola:${version}"
prefetch=""
push=0
while (($#)); do
    case "$1" in
        --prefetch) prefetch="$2"; shift 2 ;;
        --push) push=1; shift ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        -*) echo "build_image.sh: unknown option $1" >&2; exit 2 ;;
        *) tag="$1"; shift ;;
    esac
done

if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
    echo "build_image.sh: no Docker engine here (docker info fails); build on a host with Docker" >&2
    exit 1
fi

DOCKER_BUILDKIT=1 docker build --build-arg PREFETCH="${prefetch}" -t "${tag}" .
docker run --rm --entrypoint python "${tag}" -c "
import shutil, torch, pergola.cli, pergola.gateway.app, pergola.hub
assert torch.version.cuda.startswith('12.6'), torch.version.cuda
assert shutil.which('tritonserver') or __import__('os').path.exists('/opt/tritonserver/bin/tritonserver')
print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
# FlashInfer's prebuilt modules: those the start-up probe asks for (attention.flashinfer_ready)
docker run --rm -e FLASHINFER_CUDA_ARCH_LIST=9.0a --entrypoint python "${tag}" -c "
import torch
from pergola.layers.flashinfer_modules import prefill_spec
for template in ('fa2', 'fa3'):
    for head_dim in (64, 128):
        for dtype in (torch.bfloat16, torch.float16):
            spec = prefill_spec(template, head_dim, dtype)
            assert spec.is_compiled, f'FlashInfer module {spec.name} is not prebuilt in the image'
print('FlashInfer: 8 prefill modules prebuilt')"
docker image ls "${tag}" --format 'built {{.Repository}}:{{.Tag}}, {{.Size}}'
if ((push)); then docker push "${tag}"; fi
