#!/usr/bin/env bash
# Builds and pushes the qed-ray images (GPU and CPU variants) and records what was pushed by digest.
#
#   REGISTRY=ghcr.io/your-org bash docker/build.sh            # both variants
#   REGISTRY=ghcr.io/your-org bash docker/build.sh gpu        # one variant
#
# For each variant it
#   1. resolves the Ray base image tag to its digest and builds FROM that digest (a re-pushed base tag
#      cannot change the build);
#   2. refuses to push over a tag that already exists in the registry (FORCE=1 overrides): every node
#      of a cluster must run the same image, and autoscaled workers pull the tag long after the head;
#   3. builds with BuildKit (the smoke stage runs docker/smoke.sh) and pushes the exact version tag;
#   4. resolves the pushed tag to its digest and appends "<tag>@<digest>  base=<base>@<digest>" to
#      docker/images.lock. Deploy by that reference (replace the tag in the cluster configs with
#      <tag>@sha256:...) to pin every node to those bytes; cluster/check.py accepts both forms.
# Needs docker with buildx, logged in to REGISTRY.
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY="${REGISTRY:?set REGISTRY to your registry, e.g. REGISTRY=ghcr.io/your-org}"
RAY_VERSION=2.60.0
PYTHON_TAG=py311
LOCK=docker/images.lock
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

digest_of() {  # the manifest digest a reference points at (sha256:...), or nothing if it does not exist
  { docker buildx imagetools inspect "$1" --format '{{json .Manifest.Digest}}' 2> /dev/null || true; } | tr -d '"'
}

build_variant() {
  local variant=$1 base_tag="${RAY_VERSION}-${PYTHON_TAG}-$1"
  local base="rayproject/ray:${base_tag}" image="${REGISTRY}/qed-ray:${base_tag}"
  local base_digest image_digest
  base_digest=$(digest_of "$base")
  if [[ ! "$base_digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "error: cannot resolve $base to a digest (got '${base_digest}')" >&2
    return 1
  fi
  if [[ -n "$(digest_of "$image")" && "${FORCE:-0}" != 1 ]]; then
    echo "error: $image already exists in the registry; tags are never re-pushed (FORCE=1 overrides)" >&2
    return 1
  fi
  local args=(--build-arg "BASE_TAG=${base_tag}" --build-arg "BASE_IMAGE=${base}@${base_digest}")
  if [[ "$variant" == cpu ]]; then
    args+=(--build-arg "TORCH_INDEX=${CPU_TORCH_INDEX}")
  fi
  docker buildx build -f docker/Dockerfile "${args[@]}" -t "$image" --push .
  image_digest=$(digest_of "$image")
  if [[ ! "$image_digest" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "error: pushed $image but cannot resolve its digest (got '${image_digest}')" >&2
    return 1
  fi
  echo "${image}@${image_digest}  base=${base}@${base_digest}" | tee -a "$LOCK"
}

variants=("$@")
[[ ${#variants[@]} -gt 0 ]] || variants=(gpu cpu)
for variant in "${variants[@]}"; do
  case "$variant" in
    gpu | cpu) build_variant "$variant" ;;
    *) echo "error: unknown variant '$variant' (allowed: gpu, cpu)" >&2; exit 2 ;;
  esac
done
