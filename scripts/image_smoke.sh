#!/usr/bin/env bash
# Smoke test of the image, run the way users deploy it (`make test-image` runs it).
#
#   scripts/image_smoke.sh --tag IMAGE [--no-build]
#
# Builds IMAGE (scripts/build_image.sh, --device cpu; the layer cache makes a rebuild quick), then runs it
# with --memory and --cpus limits and checks: /health, a greedy completion, a streamed chat, the image's
# HEALTHCHECK, a numeric non-root user, a read-only root filesystem under an arbitrary UID (--user
# 12345:0, as OpenShift runs it) on another PORT, and a clean stop: SIGTERM while a long stream runs lets
# the stream finish, and the container exits 0. Prints start-up and first-response times, and last a line
# "N passed, N failed"; exits non-zero when a check fails.
# Environment: SMOKE_MEMORY (2g), SMOKE_CPUS (2), SMOKE_PORT (18080; SMOKE_PORT+1 is used too, both on
# 127.0.0.1), and build_image.sh's and image_lib.sh's.
set -uo pipefail
# shellcheck source=scripts/image_lib.sh
source "$(dirname "$0")/image_lib.sh"

usage() { echo "usage: $0 --tag IMAGE [--no-build]" >&2; exit 2; }
TAG=
BUILD=yes
while [ $# -gt 0 ]; do
    case $1 in
        --tag) TAG=$2; shift 2 ;;
        --no-build) BUILD=no; shift ;;
        *) usage ;;
    esac
done
[ -n "$TAG" ] || usage
check_engine

MEMORY=${SMOKE_MEMORY:-2g}
CPUS=${SMOKE_CPUS:-2}
PORT=${SMOKE_PORT:-18080}
MODEL=SmolLM2-135M-Instruct
NAME=pagedserve-smoke-$$
WORK=$(mktemp -d)
PASSED=0
FAILED=0
cleanup() {
    engine rm --force "$NAME" "$NAME-ro" > /dev/null 2>&1
    rm -rf "$WORK"
}
trap cleanup EXIT

pass() { PASSED=$((PASSED + 1)); echo "PASS  $*"; }
fail() { FAILED=$((FAILED + 1)); echo "FAIL  $*"; }
check() {  # check DESCRIPTION COMMAND...: passes when COMMAND succeeds
    local description=$1
    shift
    if "$@"; then pass "$description"; else fail "$description"; fi
}
now() { date +%s.%N; }
seconds_since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$(now)"; }
# The value at a dotted path of the JSON on stdin, e.g. json choices.0.text
json() {
    python3 -c 'import json, sys
value = json.load(sys.stdin)
for key in sys.argv[1].split("."):
    value = value[int(key)] if key.isdigit() else value[key]
print(value)' "$1"
}

# Waits until http://127.0.0.1:PORT/health answers 200 (at most 300 s) while CONTAINER runs.
wait_healthy() {
    local port=$1 container=$2
    for _ in $(seq 1500); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && return 0
        [ "$(engine inspect --format '{{.State.Running}}' "$container" 2> /dev/null)" = true ] || break
        sleep 0.2
    done
    echo "--- $container did not become healthy; its log:" >&2
    engine logs --tail 30 "$container" >&2
    return 1
}

post() {  # post PORT PATH JSON: the response body; fails on a status other than 200
    curl -sf --max-time 120 "http://127.0.0.1:$1$2" -H 'Content-Type: application/json' -d "$3"
}

completion_says_paris() {
    local body text
    body=$(post "$1" /v1/completions \
        '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}') || return 1
    text=$(json choices.0.text <<< "$body")
    echo "      completion: $(tr '\n' ' ' <<< "$text")"
    [ "$(json model <<< "$body")" = "$MODEL" ] && [[ $text == *Paris* ]]
}

chat_streams_to_done() {
    curl -sfN --max-time 120 "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' -d \
        '{"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 32,
          "temperature": 0, "stream": true}' > "$WORK/chat.sse" || return 1
    grep -q '"content"' "$WORK/chat.sse" && [ "$(grep -v '^$' "$WORK/chat.sse" | tail -1)" = "data: [DONE]" ]
}

healthcheck_passes() {  # the image's own HEALTHCHECK command, run in the container
    if [ "$ENGINE" = podman ]; then
        engine healthcheck run "$1" > /dev/null
    else  # Docker runs it every --health-interval (the runs set 2 s): wait for its verdict
        for _ in $(seq 60); do
            [ "$(engine inspect --format '{{.State.Health.Status}}' "$1")" = healthy ] && return 0
            sleep 1
        done
        return 1
    fi
}

user_is() { [ "$(engine exec "$1" id -u)" = "$2" ]; }

configured_user_is_numeric_non_root() {
    local user
    user=$(engine image inspect --format '{{.Config.User}}' "$TAG")
    echo "      USER $user"
    [[ ${user%%:*} =~ ^[0-9]+$ ]] && [ "${user%%:*}" != 0 ]
}

root_filesystem_is_read_only() { ! engine exec "$1" touch /opt/venv/probe 2> /dev/null; }

# SIGTERM (docker stop) while a 100-token stream runs: the stream gets every token ("length", usage 100)
# and [DONE], and the container exits 0. The stream ignores EOS so that its length is known.
stop_lets_the_stream_finish() {
    local container=$1 port=$2 status tokens
    curl -sN --max-time 300 "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' -d \
        '{"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": true, "temperature": 0, "stream": true,
          "stream_options": {"include_usage": true}}' > "$WORK/long.sse" &
    local stream=$!
    for _ in $(seq 300); do [ "$(grep -c '^data: {' "$WORK/long.sse")" -ge 5 ] && break; sleep 0.1; done
    echo "      stopping with $(grep -c '^data: {' "$WORK/long.sse") chunks streamed"
    # More than the server's --shutdown-timeout (30 s), so that the server, not the engine, ends it.
    engine stop --time 60 "$container" > /dev/null 2>&1
    wait "$stream"
    # The last chunk before [DONE] carries the usage.
    tokens=$(grep '^data: {' "$WORK/long.sse" | tail -1 | cut -c7- | json usage.completion_tokens 2> /dev/null)
    status=$(engine inspect --format '{{.State.ExitCode}}' "$container")
    echo "      stream: ${tokens:-no} tokens, last line '$(grep -v '^$' "$WORK/long.sse" | tail -1)'; exit code $status"
    [ "$tokens" = 100 ] && grep -q '"finish_reason":"length"' "$WORK/long.sse" \
        && [ "$(grep -v '^$' "$WORK/long.sse" | tail -1)" = "data: [DONE]" ] && [ "$status" = 0 ]
}

# ---------------------------------------------------------------- build
if [ "$BUILD" = yes ]; then
    start=$(now)
    "$ROOT/scripts/build_image.sh" --tag "$TAG" --device cpu || { fail "build $TAG"; echo "$PASSED passed, $FAILED failed"; exit 1; }
    echo "      build: $(seconds_since "$start") s"
fi
image_exists "$TAG" || { fail "image $TAG exists"; echo "$PASSED passed, $FAILED failed"; exit 1; }
probe_engine "$TAG"
echo "      image: $TAG, $(($(engine image inspect --format '{{.Size}}' "$TAG") / 1000000)) MB"
# podman runs the HEALTHCHECK on systemd timers; without systemd (as in many sandboxes) each run logs an
# error about them, so a run's stderr is shown only when it fails, and the check below runs the command
# with `podman healthcheck run`. Docker runs it itself: every 2 s here instead of 30.
HEALTH_OPTS=()
[ "$ENGINE" = podman ] || HEALTH_OPTS=(--health-interval 2s)

# ---------------------------------------------------------------- as deployed: limited memory and CPUs
start=$(now)
engine_run --detach --name "$NAME" --memory "$MEMORY" --cpus "$CPUS" "${HEALTH_OPTS[@]}" \
    --publish "127.0.0.1:$PORT:8000" "$TAG" > /dev/null 2> "$WORK/run.err" || cat "$WORK/run.err" >&2
if wait_healthy "$PORT" "$NAME"; then
    pass "/health answers 200 (--memory $MEMORY --cpus $CPUS), $(seconds_since "$start") s after docker run"
    start=$(now)
    if completion_says_paris "$PORT"; then
        pass "greedy completion says Paris (first response in $(seconds_since "$start") s)"
    else
        fail "greedy completion says Paris"
    fi
    check "streamed chat ends with data: [DONE]" chat_streams_to_done "$PORT"
    check "HEALTHCHECK passes" healthcheck_passes "$NAME"
    check "the image's USER is numeric and not root" configured_user_is_numeric_non_root
    check "the server runs as UID 10001" user_is "$NAME" 10001
    engine logs "$NAME" 2>&1 | grep -E "memory available|CPU quota of the cgroup|WARNING|ERROR" | head -5 | sed 's/^/      log: /'
    check "SIGTERM with a stream in flight: the stream completes and the container exits 0" \
        stop_lets_the_stream_finish "$NAME" "$PORT"
else
    fail "/health answers 200 (--memory $MEMORY --cpus $CPUS)"
fi

# ---------------------------------------------------------------- read-only, arbitrary UID, another PORT
# The writable paths are tmpfs mounts: the cache (exec: the CPU kernel is compiled into it and loaded
# from it) and /tmp. OpenShift runs an arbitrary UID in group 0.
start=$(now)
engine_run --detach --name "$NAME-ro" --memory "$MEMORY" --cpus "$CPUS" "${HEALTH_OPTS[@]}" \
    --read-only --user 12345:0 --tmpfs /var/cache/pagedserve:rw,exec --tmpfs /tmp \
    --env PORT=9000 --publish "127.0.0.1:$((PORT + 1)):9000" "$TAG" > /dev/null 2> "$WORK/run.err" \
    || cat "$WORK/run.err" >&2
if wait_healthy $((PORT + 1)) "$NAME-ro"; then
    pass "read-only root, --user 12345:0, PORT=9000: /health answers 200, $(seconds_since "$start") s after docker run"
    check "read-only: the root filesystem cannot be written" root_filesystem_is_read_only "$NAME-ro"
    check "read-only: the server runs as UID 12345" user_is "$NAME-ro" 12345
    check "read-only: greedy completion says Paris" completion_says_paris $((PORT + 1))
    check "read-only: HEALTHCHECK follows PORT=9000" healthcheck_passes "$NAME-ro"
    engine logs "$NAME-ro" 2>&1 | grep -E "WARNING|ERROR" | head -5 | sed 's/^/      log: /'
else
    fail "read-only root, --user 12345:0, PORT=9000: /health answers 200"
fi

echo "$PASSED passed, $FAILED failed"
[ "$FAILED" = 0 ]
