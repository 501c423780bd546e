# pergola in the NGC Triton image. Triton 24.10 = server 2.51 and CUDA 12.6; its Python backend
# runs the image's Python 3.10 (numpy 1.x). PyTorch comes from its CUDA 12.6 wheel index, so its
# CUDA runtime matches the image's driver requirements (an unpinned torch from PyPI brings
# whatever CUDA that release was built for). Build with scripts/build_image.sh.
#
#   docker run --gpus all --shm-size=2g -p 8080:8080 -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v /path/to/hf-model:/models/default:ro pergola            # a mounted folder
#   docker run --gpus all --shm-size=2g -p 8080:8080 -e HF_TOKEN pergola \
#       pergola serve --model BAAI/bge-small-en-v1.5                 # a Hub id, fetched at start
ARG TORCH_VERSION=2.7.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG FLASHINFER_VERSION=0.5.3

# FlashInfer's attention kernels, built here: the runtime image has no nvcc, and the start-up probe
# leaves out a FlashInfer kernel that would have to be compiled first (20-70 s a module), which on
# Hopper costs the most at long texts (PyTorch's FA2 takes twice FA3's time at 4 x 4,096 tokens,
# perf/RESULTS.md). The modules pergola loads (scripts/flashinfer_aot.py): the FA2 template for
# Ampere, Ada and Hopper, FA3 for Hopper, head dims 64 and 128, BF16 and FP16.
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

FROM nvcr.io/nvidia/tritonserver:24.10-py3
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
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install --no-cache-dir "numpy>=1.24,<2" "tokenizers>=0.19" "safetensors>=0.4" \
        "tritonclient[grpc,http]>=2.41" tqdm "starlette>=0.40" "uvicorn>=0.30" "uvloop>=0.19" \
        "httptools>=0.6" "orjson>=3.9" "huggingface_hub>=0.25" "prometheus-client>=0.20" \
        "opentelemetry-sdk>=1.25" "opentelemetry-exporter-otlp-proto-http>=1.25" \
 && python -c "import torch; assert torch.version.cuda.startswith('12.6'), torch.version.cuda" \
 && pip install --no-cache-dir "flashinfer-python==${FLASHINFER_VERSION}"
# FlashInfer looks for prebuilt modules in flashinfer/data/aot/<name>/<name>.so before compiling.
COPY --from=flashinfer /opt/flashinfer-aot /tmp/flashinfer-aot
RUN aot="$(python -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))')/data/aot" \
 && mkdir -p "${aot}" && cp -r /tmp/flashinfer-aot/. "${aot}/" && rm -rf /tmp/flashinfer-aot \
 && test -n "$(ls -A "${aot}")"

COPY pyproject.toml README.md ./
COPY python_models ./python_models
COPY client ./client
COPY ensemble_configs ./ensemble_configs
RUN pip install --no-cache-dir --no-deps -e .

# `pergola serve` runs the image's own tritonserver (PERGOLA_TRITON_ROOT) in explicit model-control
# mode with the stub supervisor; the repository is generated at start from the model(s) given.
ENV PERGOLA_TRITON_ROOT=/opt/tritonserver PERGOLA_REPO=/opt/model_repository PERGOLA_DEVICE=gpu \
    HF_HOME=/var/cache/huggingface
RUN if [ -n "${PREFETCH}" ]; then echo "${PREFETCH}" | xargs pergola download; fi
# 8080: the gateway. Triton's 8000-8002 listen on the container's loopback behind it unless
# PERGOLA_BIND=0.0.0.0 opens them (refused with API keys: they would be on Triton's command line).
EXPOSE 8080 8000 8001 8002
# PERGOLA_MODEL: a Hub id or folder (NAME=... to name it); default: the folder mounted at /models/default.
CMD ["sh", "-c", "exec pergola serve --model \"${PERGOLA_MODEL:-${PERGOLA_MODEL_NAME:-default}=/models/default}\""]
