# syntax=docker/dockerfile:1
# The worker image: `deploy/build-and-push.sh REGISTRY/idempotent-worker:TAG` (or
# `docker build -t idempotent-worker .`), then `docker run idempotent-worker run`.
# Build stage: a virtualenv with the package, its wheels and the [otel] and [azure]
# extras (azure-identity: Service Bus with workload identity, WORKER_SERVICEBUS_NAMESPACE).
# Every dependency ships a manylinux wheel, so neither stage needs a compiler. tini
# comes from Debian here and only its static binary reaches the final image.
#
# The base is pinned by digest (python:3.12-slim-bookworm, linux/amd64 and arm64 index):
# a tag moves with every rebuild of the official image. Refresh it deliberately, with
# the lock (deploy/lock.sh prints the current digest).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm@sha256:782412e85d0f0984994c290652577d4018aff08145c85b262bb63dc0c7522254

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
# Not pinned to a Debian revision: the base image's digest fixes the Debian release, and
# a pinned revision disappears from the mirror with the next security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/worker
WORKDIR /src
# The dependency layer: only the lock, so a change to the code reuses it. Every
# distribution is pinned and hash-checked (deploy/requirements.lock, from deploy/lock.sh),
# the build backend (setuptools) too.
COPY deploy/requirements.lock ./
RUN /opt/worker/bin/pip install --no-compile --no-deps --require-hashes -r requirements.lock
# The source layer: the package itself, built offline with the locked setuptools. The
# example application (handlers/, the default WORKER_HANDLERS=handlers) is no part of the
# package: it goes beside it, in /opt/worker/example, which a .pth file puts LAST on the
# path, so a `handlers` package of your own (in the working directory, on PYTHONPATH or
# installed) is imported before it.
COPY pyproject.toml README.md LICENSE ./
COPY worker ./worker
COPY handlers ./handlers
RUN /opt/worker/bin/pip install --no-compile --no-deps --no-index --no-build-isolation . \
    && mkdir /opt/worker/example && cp -r handlers /opt/worker/example/ \
    && /opt/worker/bin/python -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], 'idempotent_worker_example.pth').write_text('/opt/worker/example\n')" \
    && /opt/worker/bin/python -m compileall -q /opt/worker

# Final stage: the interpreter, the virtualenv, a non-root user; no pip cache, no sources.
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="idempotent-worker" \
      org.opencontainers.image.description="Broker-agnostic idempotent message consumer" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 worker \
    && useradd --system --uid 10001 --gid worker --no-log-init --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin worker
COPY --from=build /opt/worker /opt/worker
COPY --from=build /usr/bin/tini-static /usr/bin/tini
# Bytecode is compiled above: with a read-only root filesystem nothing is written at run time.
ENV PATH=/opt/worker/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    WORKER_OPS_PORT=8080 \
    WORKER_LOG_FORMAT=json \
    TINI_SUBREAPER=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8080
# Liveness from inside the container (docker, compose); Kubernetes uses its own probes.
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('WORKER_OPS_PORT', '8080') + '/healthz', timeout=2)"]
# The source revision (deploy/build-and-push.sh passes `git rev-parse HEAD`): shown by
# `worker --version` and exported as worker_build_info{revision}. Last, so a new
# revision rebuilds only this layer.
ARG REVISION=unknown
LABEL org.opencontainers.image.revision="${REVISION}"
ENV IDEMPOTENT_WORKER_REVISION=${REVISION}
# tini is PID 1: it forwards SIGTERM to the worker and reaps zombies. Python as PID 1
# would get no signal it has no handler for (the kernel drops them), so a SIGTERM in
# its first moments would wait for the kubelet's SIGKILL. (`docker run --init` and
# compose's `init: true` add an init too; tini then runs under it as a subreaper,
# TINI_SUBREAPER, and still reaps the worker's children.)
ENTRYPOINT ["/usr/bin/tini", "--", "worker"]
CMD ["run"]
