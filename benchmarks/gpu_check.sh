#!/usr/bin/env bash
# The device check on an H100/H200 (about 2 minutes on an H200): greedy parity with transformers on tiny
# models, the Triton attention kernels vs the torch reference, offline throughput and decode step time and
# breakdown vs the roofline on a random Llama-3.2-1B-shape model, LoRA adapters vs transformers + PEFT and
# their speed (benchmarks/gpu/). Needs torch (CUDA), triton, transformers, llguidance and peft, with
# pagedserve importable (pip install -e . --no-deps); not fastapi, uvicorn or gguf. Results:
# gpu_check_<device>.json and .md under --out.
#
#   benchmarks/gpu_check.sh [--sections greedy_parity,attention_kernels,throughput,decode_steps,lora] [--quick]
#                           [--out benchmarks/results/]
#   benchmarks/gpu_check.sh --device cpu --quick          # dry run without a GPU
#
# Python: $PYTHON if set, else the repo's .venv, else python3 -- the first whose torch imports
# (and, unless --device cpu, sees a CUDA device).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

dry_run=0
previous=""
for arg in "$@"; do
    if [[ "$arg" == "--device=cpu" || ( "$previous" == "--device" && "$arg" == "cpu" )
          || "$arg" == "-h" || "$arg" == "--help" ]]; then
        dry_run=1
    fi
    previous="$arg"
done

if [[ $dry_run == 1 ]]; then
    probe="import torch, transformers"
else
    probe="import sys, torch, transformers; sys.exit(0 if torch.cuda.is_available() else 3)"
fi
python=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
    if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$probe" 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [[ -z "$python" ]]; then
    if [[ $dry_run == 1 ]]; then
        echo "gpu_check: no Python with torch and transformers found (set PYTHON=...)." >&2
        exit 1
    fi
    echo "gpu_check: no CUDA device visible to any Python with torch and transformers; nothing measured" \
         "(pass --device cpu for a dry run)."
    exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [[ $dry_run == 1 ]]; then
    export TRITON_INTERPRET=1  # Triton kernels run in its interpreter on the CPU
    exec "$python" -m benchmarks.gpu_check "$@"
fi
# A hard stop inside the 6 minutes: parts start only within --time-budget (300 s), and the summary
# files are rewritten after every part, so an interrupted run still leaves what it measured.
exec timeout --signal=INT --kill-after=20 "${GPU_CHECK_TIMEOUT_S:-340}" "$python" -m benchmarks.gpu_check "$@"
