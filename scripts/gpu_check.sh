#!/usr/bin/env bash
# The checks #4 asks for on a GPU, for a machine that has one and a CUDA build of torch (this
# script installs nothing: a CPU torch from scripts/setup.sh would hide the GPU). Runs from the
# checkout with PYTHONPATH=src; writes each part's output and JSON under $OUT (default out/gpu;
# a relative OUT is from the directory it is run from).
#
#   bash scripts/gpu_check.sh tests     # the GPU tests (pytest -m gpu), a few minutes
#   bash scripts/gpu_check.sh submit    # host and GPU time per job: compiled, coalesced, torch
#   bash scripts/gpu_check.sh bw        # transfer_bw.py, plain and coalesced (depth 2), in turn
#   bash scripts/gpu_check.sh e2e       # e2e_hf.py: TTFT of a 1B-shaped bf16 model, 1k-16k prefixes
#   bash scripts/gpu_check.sh all       # the four, one after the other
#
# On an H200 machine the GPU tests took 20-70 s (221 tests), submit 9 s, each bw run about 30 s
# and e2e 60 s.
set -euo pipefail
# A relative OUT is from the caller's directory, as demo.sh's paths are, not the checkout's.
OUT="${OUT:-}"
if [ -n "$OUT" ] && [ "${OUT#/}" = "$OUT" ]; then
    OUT="$PWD/$OUT"
fi
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu}"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export KVTIER_CACHE_DIR="${KVTIER_CACHE_DIR:-/tmp/kvtier-gpu-cache}"
export HF_HUB_OFFLINE=1
PY="${PYTHON:-python}"

# Refusals first, before anything is written.
part="${1:-all}"
case "$part" in tests | submit | bw | e2e | all) ;; *)
    echo "unknown part '$part'; expected tests, submit, bw, e2e or all" >&2
    exit 2
    ;;
esac
"$PY" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: no CUDA device visible to torch {torch.__version__}; run it on a GPU")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}")
EOF
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"

if [[ $part == tests || $part == all ]]; then
    echo "== GPU tests"
    "$PY" -m pytest -q -m gpu tests/transfer tests/integrations/hf 2>&1 | tee "$OUT/gpu_tests.txt"
fi
if [[ $part == submit || $part == all ]]; then
    echo "== per-job host and GPU time"
    "$PY" benchmarks/cuda_submit.py --cases 256x1 1024x1 256x16 64x16 --rounds 5 \
        --json "$OUT/submit.json" 2>&1 | tee "$OUT/submit.txt"
fi
if [[ $part == bw || $part == all ]]; then
    B=(--backend cuda --pages-kib 64 256 1024 2048 --batches 1 16 128 --moved-mib 1024
        --region-mib 2048 --repeats 5)
    for round in 1 2; do # alternating, so that drift shows in both
        echo "== transfer_bw, round $round: plain"
        "$PY" benchmarks/transfer_bw.py "${B[@]}" --json "$OUT/bw_plain_$round.json" 2>&1 |
            tee "$OUT/bw_plain_$round.txt"
        echo "== transfer_bw, round $round: coalesced (depth 2)"
        "$PY" benchmarks/transfer_bw.py "${B[@]}" --coalesce-depth 2 \
            --json "$OUT/bw_coalesced_$round.json" 2>&1 | tee "$OUT/bw_coalesced_$round.txt"
    done
fi
if [[ $part == e2e || $part == all ]]; then
    echo "== TTFT, kvtier against recompute"
    "$PY" benchmarks/e2e_hf.py --device cuda --dtype bfloat16 --size 1b \
        --prefixes 1024,4096,8192,16384 --repeats 7 --rounds 24 --json "$OUT/e2e_1b.json" 2>&1 |
        tee "$OUT/e2e_1b.txt"
fi
