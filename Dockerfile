# ortbatch serve in a container: `ortbatch[cpu,serve,tracing]` (or `[gpu,...]`) from this checkout, a
# non-root user, the exports mounted read-only at /models. deploy/README.md says how it is used and
# tested; deploy/kubernetes/ runs it.
#
#   CPU: docker build -t ortbatch:0.1.0 .
#   GPU: docker build -t ortbatch:0.1.0-gpu --build-arg EXTRA=gpu \
#          --build-arg BASE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04 .
#   run: docker run --rm -p 8000:8000 -p 8001:8001 -v "$PWD/exports/minilm:/models:ro" \
#          -e ORTBATCH_MODEL_NAME=minilm ortbatch:0.1.0
#
# BASE is any Debian or Ubuntu image. One with Python (>= 3.10, with venv) is used as it is;
# one without (the CUDA runtime images) gets the distribution's python3 and python3-venv.
# The base must carry the CUDA major version the onnxruntime-gpu wheel links (PyPI's 1.31: CUDA 13,
# libcudart.so.13) and cuDNN 9: the -cudnn-runtime images.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS python
RUN set -eu; \
    if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/ortbatch
ENV PATH=/opt/ortbatch/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# The wheel, built from the build context (.dockerignore keeps all but the package out).
FROM python AS wheel
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheel /src

FROM python
ARG EXTRA=cpu
COPY --from=wheel /wheel /tmp/wheel
# tracing: OpenTelemetry, imported only when an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT).
# None of these extras asks for torch; the check keeps it so (a default index would bring a CUDA
# build of several GB). dumb-init is PID 1: it passes SIGTERM on to ortbatch serve, which drains,
# and reaps what --frontends starts.
RUN set -eu; \
    pip install "$(ls /tmp/wheel/ortbatch-*.whl)[${EXTRA},serve,tracing]" "dumb-init==1.2.5.post1"; \
    rm -rf /tmp/wheel; \
    if python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then \
        echo "torch was installed: ortbatch[${EXTRA},serve,tracing] must not need it" >&2; exit 1; \
    fi; \
    useradd --no-log-init --uid 10001 --user-group --create-home --home-dir /home/ortbatch ortbatch; \
    mkdir -p /models
COPY deploy/docker/entrypoint.sh /usr/local/bin/ortbatch-entrypoint
COPY deploy/docker/healthcheck.py /usr/local/lib/ortbatch/healthcheck.py

ENV ORTBATCH_MODELS=/models \
    ORTBATCH_HTTP_PORT=8000 \
    ORTBATCH_GRPC_PORT=8001 \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /home/ortbatch
EXPOSE 8000 8001
# SIGTERM: ortbatch serve stops accepting, answers every request it has (up to
# --graceful-timeout-s, 60 s by default), then exits 0. Give `docker stop` that long: -t 70.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/lib/ortbatch/healthcheck.py"]
ENTRYPOINT ["dumb-init", "--single-child", "--", "ortbatch-entrypoint"]
