#!/bin/bash
# Build a minimal Debian 12 base image locally, for machines that cannot pull
# from a registry: debootstrap a minbase root filesystem, trim what a server
# image never reads, and `docker import` it.
#   deploy/build-base-image.sh [TAG]        (default TAG: local/debian:bookworm-minbase)
# Needs root, debootstrap (apt-get install debootstrap) and a Docker engine.
set -euo pipefail

tag=${1:-local/debian:bookworm-minbase}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}

[ "$(id -u)" = 0 ] || { echo "build-base-image: must run as root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build-base-image: apt-get install debootstrap" >&2; exit 1; }

root=$(mktemp -d /var/tmp/cri-shim-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

debootstrap --variant=minbase bookworm "$root" "$mirror"

# The same apt sources the image will use to install its packages.
echo "deb $mirror bookworm main" >"$root/etc/apt/sources.list"
# Keep later apt runs from filling the image with docs and caches.
cat >"$root/etc/dpkg/dpkg.cfg.d/01-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
cat >"$root/etc/apt/apt.conf.d/01-slim" <<'CFG'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
CFG
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/*
find "$root/usr/share/doc" -mindepth 2 ! -name copyright -delete 2>/dev/null || true
: >"$root/etc/resolv.conf"
: >"$root/etc/hostname"

tar -C "$root" --numeric-owner -c . | "$docker" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - "$tag"
"$docker" image inspect --format '{{.Id}} {{.Size}}' "$tag"
