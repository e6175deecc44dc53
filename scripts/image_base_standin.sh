#!/usr/bin/env bash
# Builds a stand-in for the CPU base image (python:3.11-slim-bookworm) from Debian's own packages, for
# machines that reach Debian's mirror but no container registry. Debian bookworm's python3 is 3.11, the
# Python the torch wheels on such machines are built for (cp311).
#
#   scripts/image_base_standin.sh --tag python:3.11-slim-bookworm
#
# The root filesystem is cached as a tarball in .image-cache/ (ignored by git and by the build context),
# so only the first run pays for debootstrap (about a minute). Needs root (debootstrap chroots).
# Environment: DEBIAN_MIRROR (http://deb.debian.org/debian) and scripts/image_lib.sh's.
set -euo pipefail
# shellcheck source=scripts/image_lib.sh
source "$(dirname "$0")/image_lib.sh"

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
TAG=
while [ $# -gt 0 ]; do
    case $1 in
        --tag) TAG=$2; shift 2 ;;
        *) echo "usage: $0 --tag NAME" >&2; exit 2 ;;
    esac
done
[ -n "$TAG" ] || { echo "usage: $0 --tag NAME" >&2; exit 2; }
check_engine

tarball=$CACHE/$SUITE-python3.tar
if [ ! -f "$tarball" ]; then
    command -v debootstrap > /dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    mkdir -p "$CACHE"
    rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap $SUITE from $MIRROR (once; cached as $tarball)"
    # minbase: what the slim images hold (dpkg, apt, a shell); plus what they add: Python with venv and
    # the CA certificates pip needs for https.
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$MIRROR" >&2
    # As in Docker's Debian images: no package lists (apt-get update fetches them) and no downloaded debs.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    # The official image calls its interpreter `python` too.
    ln -sf python3 "$rootfs/usr/bin/python"
    tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
fi
engine import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tarball" "$TAG" > /dev/null
log "$TAG: stand-in imported from $tarball"
