# pergola in the NGC Triton image. Triton 24.10 = server 2.51, whose Python backend runs the
# image's Python 3.10 (numpy 1.x). No weights are baked in: mount a Hugging Face folder.
#
#   docker build -t pergola .
#   docker run --gpus all --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
#       -v /path/to/hf-model:/models/default:ro pergola
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/pergola
COPY pyproject.toml README.md ./
COPY python_models ./python_models
COPY client ./client
COPY ensemble_configs ./ensemble_configs
# The image already has tritonserver; nvidia-pytriton is only for Docker-less use.
RUN pip install --no-cache-dir "numpy<2" torch tokenizers safetensors "tritonclient[grpc,http]" tqdm \
    starlette uvicorn uvloop httptools orjson \
 && pip install --no-cache-dir --no-deps -e . \
 && (pip install --no-cache-dir flashinfer-python || echo "flashinfer-python not installed: PyTorch FA2 is used")

# `pergola serve` runs the image's own tritonserver (PERGOLA_TRITON_ROOT) in explicit model-control
# mode with the stub supervisor; the repository is generated from the mounted folder at start.
ENV PERGOLA_TRITON_ROOT=/opt/tritonserver PERGOLA_REPO=/opt/model_repository PERGOLA_DEVICE=gpu
EXPOSE 8080 8000 8001 8002
CMD ["sh", "-c", "exec pergola serve --model ${PERGOLA_MODEL_NAME:-default}=/models/default"]
