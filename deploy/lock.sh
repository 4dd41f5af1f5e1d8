#!/usr/bin/env bash
# Regenerates deploy/requirements.lock, the image's hash-locked dependencies (and its
# build backend), for the image's Python (3.12, manylinux x86_64). Run it after a
# change to pyproject.toml's dependencies or to refresh the pins; commit the result.
#   pip install uv && deploy/lock.sh
# It also prints the current digest of the base image, when docker can reach the
# registry, to refresh PYTHON_IMAGE in the Dockerfile (a tag's digest moves with every
# rebuild of the official image: refresh it with the lock, deliberately).
set -euo pipefail
cd "$(dirname "$0")/.."
uv pip compile pyproject.toml deploy/build-backend.in --extra otel --extra azure \
  --generate-hashes --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --no-header --custom-compile-command "deploy/lock.sh" -o deploy/requirements.lock
if command -v docker >/dev/null 2>&1; then
  docker buildx imagetools inspect python:3.12-slim-bookworm --format '{{json .Manifest.Digest}}' \
    || echo "could not read the base image's digest (no registry access?)" >&2
fi
