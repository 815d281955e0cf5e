# feta-release: one image for site nodes, the coordinator and offline synthesis.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/feta-release

# Same install as the README: the CPU build of torch first (pinned), then the project.
# Outside the development machines the CPU wheel comes from PyTorch's CPU index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}

COPY pyproject.toml README.md ./
COPY feta_release ./feta_release
COPY edge ./edge
COPY coordinator ./coordinator
COPY policies ./policies
RUN pip install .

# Site data, ledgers and keys live in volumes, never in the image.
VOLUME ["/data", "/state"]
EXPOSE 9093 9101
ENTRYPOINT ["feta-release"]
CMD ["--help"]
