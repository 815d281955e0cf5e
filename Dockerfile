# feta-release: one image for site nodes, the coordinator and offline synthesis. Runs as a non-root user.
# Build:  docker build -t feta-release .
# Run lines for a node and a coordinator: README, "Site administrators".
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/feta-release

# Same install as the README's for a site node, pinned by hash (docs/supply-chain.md): every wheel, the CPU build
# of torch (torch==2.13.0+cpu, from PyTorch's CPU index) and the build backend included, must match a sha256 in
# requirements-node.lock (CPython 3.11, linux x86_64); then the project itself, with no other download.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY requirements-node.lock ./
RUN pip install --require-hashes --no-deps -r requirements-node.lock --extra-index-url ${TORCH_INDEX_URL}

COPY pyproject.toml README.md ./
COPY feta_release ./feta_release
COPY edge ./edge
COPY coordinator ./coordinator
COPY policies ./policies
RUN pip install --no-deps --no-build-isolation . && pip check

# An unprivileged user owns the state; site data is mounted read-only by the operator (docker run -v ...:ro).
ARG UID=10001
RUN useradd --system --uid ${UID} --create-home --home-dir /home/feta feta \
    && mkdir -p /data /state && chown feta:feta /state
USER feta
WORKDIR /state
ENV HOME=/home/feta

# Site data, ledgers, keys and site kits live in volumes, never in the image.
VOLUME ["/data", "/state"]
# 9092: the coordinator's SuperLink (Fleet, Control and Runtime APIs on one port; `coordinator start --port`).
# A site node only dials out to it (node.toml superlink = "HOST:9092"); its ClientApp port 9101 stays on loopback.
EXPOSE 9092
ENTRYPOINT ["feta-release"]
CMD ["--help"]
