# streamtrain service image: `streamtrain serve` (default) or `streamtrain simulate ...`.
#
#   docker build -t streamtrain:local .
#   docker run -p 8000:8000 -e STREAMTRAIN_KAFKA_BOOTSTRAP=broker:9092 streamtrain:local
#
# torch's default wheels bring CUDA libraries (several GB) although the service trains on
# the CPU; for a smaller image pass a CPU-only wheel index:
#   docker build --build-arg TORCH_INDEX_URL=<cpu wheel index> -t streamtrain:local .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/streamtrain

# jemalloc: under glibc's malloc the service's RSS settles far above what it uses
# (docs/operations.md, "Memory"). One fixed path for LD_PRELOAD whatever the architecture.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s "$(find /usr/lib -name libjemalloc.so.2 | head -n1)" /usr/local/lib/libjemalloc.so.2

# Package metadata and source only (see .dockerignore); the install is the image's one heavy layer.
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} . && rm -rf /root/.cache

# Default configs of the deployable services (services/*/ *.toml, run.sh).
COPY services ./services

# Unprivileged user; it owns its home and the checkpoint volume, nothing else.
RUN groupadd --system --gid 10001 streamtrain \
 && useradd --system --uid 10001 --gid streamtrain --create-home --home-dir /home/streamtrain --shell /usr/sbin/nologin streamtrain \
 && mkdir -p /var/lib/streamtrain \
 && chown streamtrain:streamtrain /var/lib/streamtrain

# preloaded for what the container runs, not for the build steps above
ENV LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \
    STREAMTRAIN_HTTP_HOST=0.0.0.0 \
    STREAMTRAIN_HTTP_PORT=8000 \
    STREAMTRAIN_CHECKPOINT_DIR=/var/lib/streamtrain

VOLUME ["/var/lib/streamtrain"]
USER 10001:10001
EXPOSE 8000

# slim has no curl: probe /healthz with the standard library (non-zero exit on any error).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('STREAMTRAIN_HTTP_PORT', '8000'), timeout=4)"]

CMD ["streamtrain", "serve", "--config", "/opt/streamtrain/services/trainer/trainer.toml"]
