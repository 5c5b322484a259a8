#!/bin/bash
# Build the cri-shim image from this checkout.
#   deploy/build-image.sh [--base IMAGE] [--ca FILE] [--tag TAG]
#     --base IMAGE  Debian 12 base (default: $BASE_IMAGE, else local/debian:bookworm-minbase,
#                   built by deploy/build-base-image.sh when it is missing)
#     --ca FILE     a CA bundle to trust while downloading from PyPI in the build stage
#                   (default: $PIP_CERT when set), for TLS-intercepting proxies
#     --tag TAG     default cri-shim:VERSION from pyproject.toml
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
docker=${DOCKER:-docker}
base=${BASE_IMAGE:-local/debian:bookworm-minbase}
ca=${PIP_CERT:-}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n 1)
tag=cri-shim:$version

while [ $# -gt 0 ]; do
    case $1 in
    --base) base=$2; shift 2 ;;
    --ca) ca=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    *) echo "usage: $0 [--base IMAGE] [--ca FILE] [--tag TAG]" >&2; exit 2 ;;
    esac
done

if ! "$docker" image inspect "$base" >/dev/null 2>&1; then
    if [ "$base" = local/debian:bookworm-minbase ]; then
        "$repo/deploy/build-base-image.sh" "$base"
    else
        echo "build-image: base image $base is not present (docker pull it, or use the local one)" >&2
        exit 1
    fi
fi

extra=$repo/deploy/image/extra-ca.crt
if [ -n "$ca" ]; then
    cp "$ca" "$extra"
    trap 'rm -f "$extra"' EXIT
fi

# The legacy builder is enough (no BuildKit-only syntax) and is what every engine has.
DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0} "$docker" build --build-arg "BASE_IMAGE=$base" -t "$tag" "$repo"
"$docker" image inspect --format "$tag: {{.Size}} bytes" "$tag"
