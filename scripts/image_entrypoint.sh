#!/bin/sh
# The image's entrypoint: `pagedserve serve` with the image's config, model and port, then the run's
# arguments.
#   docker run IMAGE [MODEL] [FLAGS...]
# PAGEDSERVE_CONFIG, PAGEDSERVE_MODEL and PORT come from the image's ENV or `-e` (the HEALTHCHECK reads the
# same PORT: change the port with -e PORT, not --port); an empty PAGEDSERVE_MODEL leaves the model to the
# config file. A first argument that is not a flag is the model, as in `pagedserve serve MODEL`. The
# run's flags come last, and the last flag wins, so they override all of these.
set -e
case ${1:-} in
    "" | -*) ;;
    *) PAGEDSERVE_MODEL=$1; shift ;;
esac
if [ -n "${PAGEDSERVE_MODEL:-}" ]; then set -- --model "$PAGEDSERVE_MODEL" "$@"; fi
if [ -n "${PAGEDSERVE_CONFIG:-}" ]; then set -- --config "$PAGEDSERVE_CONFIG" "$@"; fi
# exec: the server becomes PID 1 and receives docker stop's SIGTERM itself.
exec pagedserve serve --host 0.0.0.0 --port "${PORT:-8000}" "$@"
