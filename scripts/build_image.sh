#!/usr/bin/env bash
# Builds the pagedserve image with podman or docker (`make image` runs it).
#
#   scripts/build_image.sh --tag pagedserve:latest [--device cpu|cuda] [-- EXTRA BUILD OPTIONS]
#
# It also builds where no container registry or PyTorch index can be reached (a sandbox, an air gap):
# - The base image is used when present, else pulled. When the pull fails and the device is cpu, a
#   stand-in is built from Debian's packages (scripts/image_base_standin.sh) and tagged with the base
#   image's name, so the Dockerfile is built unchanged.
# - When PyTorch's index or PyPI does not answer from the base image, the wheels that `pip download` resolves on this machine
#   are served from a loopback index (scripts/image_wheel_index.py, on 127.0.0.1) and the build runs on
#   the host's network to reach it.
# Environment: CPU_BASE_IMAGE, CUDA_BASE_IMAGE, TORCH_INDEX_URL, PIP_INDEX_URL (build arguments, passed on
# when set); IMAGE_INDEX=auto|loopback|off (auto: loopback for the indexes that do not answer; loopback:
# for both, a build that downloads nothing; off: never); IMAGE_INDEX_PORT (18765), IMAGE_PYTHON_VERSION
# (the base image's Python, 3.11); and scripts/image_lib.sh's.
set -euo pipefail
# shellcheck source=scripts/image_lib.sh
source "$(dirname "$0")/image_lib.sh"

usage() { echo "usage: $0 --tag IMAGE [--device cpu|cuda] [-- EXTRA BUILD OPTIONS]" >&2; exit 2; }
TAG=
DEVICE=cpu
EXTRA=()
while [ $# -gt 0 ]; do
    case $1 in
        --tag) TAG=$2; shift 2 ;;
        --device) DEVICE=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) usage ;;
    esac
done
[ -n "$TAG" ] || usage
case $DEVICE in cpu | cuda) ;; *) usage ;; esac
check_engine

# The Dockerfile's own default for an argument.
dockerfile_default() { sed -n "s/^ARG $1=//p" "$ROOT/Dockerfile"; }

URLOPEN='import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)'
reachable() {  # URL answers here (any HTTP status below 400) within 10 s
    python3 -c "$URLOPEN" "$1" 2> /dev/null
}
# As the build would see it: this machine may trust a proxy's certificate authority that the base image
# does not. Bases without Python (CUDA's) are probed from here.
reachable_from_build() {
    if engine_run --rm --network host --entrypoint python3 "$BASE" -c pass > /dev/null 2>&1; then
        engine_run --rm --network host --entrypoint python3 "$BASE" -c "$URLOPEN" "$1" > /dev/null 2>&1
    else
        reachable "$1"
    fi
}

BUILD_ARGS=(--build-arg "DEVICE=$DEVICE")
for name in CPU_BASE_IMAGE CUDA_BASE_IMAGE TORCH_INDEX_URL PIP_INDEX_URL; do
    [ -z "${!name:-}" ] || BUILD_ARGS+=(--build-arg "$name=${!name}")
done

# ---------------------------------------------------------------- base image
if [ "$DEVICE" = cuda ]; then BASE_VAR=CUDA_BASE_IMAGE; else BASE_VAR=CPU_BASE_IMAGE; fi
BASE=${!BASE_VAR:-$(dockerfile_default "$BASE_VAR")}
if image_exists "$BASE"; then
    log "base image $BASE: present"
elif pull_error=$(engine pull "$BASE" 2>&1 > /dev/null); then
    log "base image $BASE: pulled"
elif [ "$DEVICE" = cpu ]; then
    log "base image $BASE: cannot pull ($(tail -1 <<< "$pull_error")); building a stand-in from Debian packages"
    "$ROOT/scripts/image_base_standin.sh" --tag "$BASE"
else
    die "cannot pull $BASE: $(tail -1 <<< "$pull_error"); set $BASE_VAR to a mirror's copy"
fi
probe_engine "$BASE"

# ---------------------------------------------------------------- package indexes
if [ "$DEVICE" = cuda ]; then TORCH_DEFAULT=https://download.pytorch.org/whl/cu128; else TORCH_DEFAULT=https://download.pytorch.org/whl/cpu; fi
TORCH_INDEX=${TORCH_INDEX_URL:-$TORCH_DEFAULT}
PIP_INDEX=${PIP_INDEX_URL:-$(dockerfile_default PIP_INDEX_URL)}
LOOPBACK=()
case ${IMAGE_INDEX:-auto} in
    loopback) LOOPBACK=(TORCH_INDEX_URL PIP_INDEX_URL) ;;
    off) ;;
    auto)
        reachable_from_build "$TORCH_INDEX/torch/" || LOOPBACK+=(TORCH_INDEX_URL)
        reachable_from_build "$PIP_INDEX/pip/" || LOOPBACK+=(PIP_INDEX_URL) ;;
    *) die "IMAGE_INDEX must be auto, loopback or off" ;;
esac
NETWORK=()
if [ ${#LOOPBACK[@]} -gt 0 ]; then
    # The wheels resolved here are for this machine's torch build: CPU, unless pip is configured otherwise.
    [ "$DEVICE" = cpu ] || log "warning: serving this machine's torch wheel to a CUDA build"
    port=${IMAGE_INDEX_PORT:-18765}
    python3 "$ROOT/scripts/image_wheel_index.py" "$CACHE/wheels" --python-version "${IMAGE_PYTHON_VERSION:-3.11}"
    python3 -m http.server --bind 127.0.0.1 --directory "$CACHE/wheels" "$port" > /dev/null 2>&1 &
    index_pid=$!
    trap 'kill "$index_pid" 2> /dev/null || true' EXIT
    for _ in $(seq 50); do reachable "http://127.0.0.1:$port/simple/" && break; sleep 0.1; done
    reachable "http://127.0.0.1:$port/simple/" || die "the loopback index did not start on port $port"
    for name in "${LOOPBACK[@]}"; do
        log "$name: http://127.0.0.1:$port/simple (loopback; ${name%_URL} did not answer)"
        BUILD_ARGS+=(--build-arg "$name=http://127.0.0.1:$port/simple")
    done
    # The build's containers reach the host's 127.0.0.1 only on the host's network.
    NETWORK=(--network host)
fi

# ---------------------------------------------------------------- build
VERSION=$(python3 -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['project']['version'])" \
    "$ROOT/pyproject.toml")
REVISION=$(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)
[ -z "$(git -C "$ROOT" status --porcelain 2> /dev/null)" ] || REVISION="$REVISION-dirty"
BUILD_ARGS+=(--build-arg "VERSION=$VERSION" --label "org.opencontainers.image.revision=$REVISION"
             --label "org.opencontainers.image.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
FORMAT=()
# podman writes OCI images by default, which have no HEALTHCHECK; Docker's format keeps it.
[ "$ENGINE" != podman ] || FORMAT=(--format docker)

log "building $TAG ($DEVICE) with $ENGINE"
start=$(date +%s)
engine build "${FORMAT[@]}" "${NETWORK[@]}" "${BUILD_ARGS[@]}" "${EXTRA[@]}" --tag "$TAG" --file "$ROOT/Dockerfile" "$ROOT"
size=$(engine image inspect --format '{{.Size}}' "$TAG")
log "built $TAG in $(($(date +%s) - start)) s: $((size / 1000000)) MB"
