#!/usr/bin/env bash
# Build the worker image, push it, and print the reference to deploy, pinned by digest:
#   deploy/build-and-push.sh registry.example.com/team/idempotent-worker:0.1.0
# Needs docker with buildx, logged in to the registry (docker login). PLATFORMS
# (default linux/amd64) may list several, e.g. PLATFORMS=linux/amd64,linux/arm64.
# BuildKit attaches an SBOM (SPDX) and provenance attestation to the pushed image:
#   docker buildx imagetools inspect IMAGE --format '{{ json .SBOM }}'
# The last line printed is the image@sha256:... for the chart's image.repository and
# image.digest (or a kustomization's `images:`).
set -euo pipefail
image="${1:?usage: deploy/build-and-push.sh REGISTRY/REPOSITORY:TAG}"
case "$image" in
  *:*) ;;
  *) echo "deploy/build-and-push.sh: $image has no tag (REGISTRY/REPOSITORY:TAG)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
metadata="$(mktemp)"
trap 'rm -f "$metadata"' EXIT
docker buildx build \
  --platform "${PLATFORMS:-linux/amd64}" \
  --build-arg "REVISION=$revision" \
  --sbom=true --provenance=mode=max \
  --metadata-file "$metadata" \
  --tag "$image" --push .
digest="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["containerimage.digest"])' "$metadata")"
echo "pushed $image (revision $revision)" >&2
echo "${image%:*}@${digest}"
