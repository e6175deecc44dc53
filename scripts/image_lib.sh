# shellcheck shell=bash
# Sourced by scripts/build_image.sh and scripts/image_smoke.sh: the container engine and the options
# this machine needs. Environment overrides:
#   CONTAINER_ENGINE       podman or docker (default: podman if installed, else docker)
#   CONTAINER_ENGINE_OPTS  global options for every engine command, e.g. "--storage-driver vfs";
#                          setting it (or CONTAINER_RUN_OPTS) turns the probe below off
#   CONTAINER_RUN_OPTS     options for every `run`, e.g. "--ulimit nofile=4096:4096"
#   IMAGE_CACHE_DIR        debootstrap rootfs and wheels, kept between runs (default: .image-cache)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck disable=SC2034  # used by the scripts that source this file
CACHE=${IMAGE_CACHE_DIR:-$ROOT/.image-cache}
ENGINE=${CONTAINER_ENGINE:-$(basename "$(command -v podman || command -v docker || echo none)")}
read -ra ENGINE_OPTS <<< "${CONTAINER_ENGINE_OPTS:-}"
read -ra RUN_OPTS <<< "${CONTAINER_RUN_OPTS:-}"

log() { echo "[$(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }

engine() { "$ENGINE" "${ENGINE_OPTS[@]}" "$@"; }

engine_run() { engine run "${RUN_OPTS[@]}" "$@"; }

image_exists() { engine image inspect "$1" > /dev/null 2>&1; }

# Finds the options under which a container runs here, trying `true` in IMAGE. Two host limits are
# known to stop podman with its defaults:
# - crun refuses hosts with cgroup v1 and v2 hierarchies both holding controllers ("cgroups in hybrid
#   mode not supported"); runc runs there, --memory and --cpus included.
# - without CAP_SYS_RESOURCE a container cannot get podman's default open-files and processes limits
#   above the host's ("setrlimit ... operation not permitted"); ask for the host's own.
probe_engine() {
    local image=$1 err runc=no ulimits=no
    [ -z "${CONTAINER_ENGINE_OPTS+set}${CONTAINER_RUN_OPTS+set}" ] || return 0
    # Each failure shows one limit at a time: fix it and try again.
    while ! err=$(engine_run --rm --entrypoint true "$image" 2>&1); do
        if [[ $err == *"hybrid mode"* && $runc == no ]] && command -v runc > /dev/null; then
            runc=yes
            ENGINE_OPTS+=(--runtime runc)
        elif [[ $err == *[Rr][Ll][Ii][Mm][Ii][Tt]* && $ulimits == no ]]; then
            ulimits=yes
            RUN_OPTS+=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)
        else
            die "$ENGINE cannot run a container here (set CONTAINER_ENGINE_OPTS / CONTAINER_RUN_OPTS): $err"
        fi
    done
    [ "$runc$ulimits" = nono ] || log "$ENGINE: options for this host: ${ENGINE_OPTS[*]} run ${RUN_OPTS[*]}"
}

check_engine() {
    case $ENGINE in
        podman | docker) ;;
        *) die "neither podman nor docker is installed (or set CONTAINER_ENGINE)" ;;
    esac
    engine version > /dev/null 2>&1 || die "$ENGINE does not answer: $(engine version 2>&1 | tail -1)"
}
