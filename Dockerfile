# syntax=docker/dockerfile:1
# One image, two entrypoints: `refit` (the operator, `refit operator`) and `refit-worker`
# (policy and rollout pods), plus `refit-signal` for the preStop hook.
#
#   docker build -t refit:cpu .                              # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 -t refit:cu128 .   # CUDA 12.8 torch
#
# Every install step lives in docker/install.sh; tests/e2e/test_image_install.py replays it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# torch first, in its own layer: it is the largest download and changes least often.
COPY constraints.txt ./
COPY docker/install.sh docker/install.sh
RUN TORCH_VARIANT="${TORCH_VARIANT}" sh docker/install.sh torch /opt/venv /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY worker worker
RUN sh docker/install.sh project /opt/venv /src

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 refit \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin refit
# Same base image, so the venv's interpreter link (/usr/local/bin/python3) still resolves.
COPY --from=builder /opt/venv /opt/venv
# Bytecode was compiled at install time; the operator runs with a read-only root filesystem.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
CMD ["refit", "--help"]
