#!/usr/bin/env bash
# The aggregator sweep of docs/results/aggregators.md (66 runs of the nano model; about 45
# minutes on 2 free CPU cores, 2 hours on a busy one). Resumable: rerun to continue.
# Usage: bash docs/results/aggregators.sh [RESULTS_DIR]
set -euo pipefail
export OMP_NUM_THREADS=1
mkdir -p "$(dirname "${1:-results/aggregators}")"  # mloco creates its output, not its parents
mloco compare \
  --aggregators diloco,diloco-sgd,isoloco,isoloco-ns,isoc-sgd,ties,tsv,iso-cts \
  --workers 2,4,8,16 --inner-steps 10 --seeds 2 \
  --model nano --data stdlib --global-batch 16 --seq-len 128 --tokens 327680 \
  --val-tokens 32768 --eval-every 4 --jobs 2 \
  -o "${1:-results/aggregators}"
python docs/results/aggregator_claims.py "${1:-results/aggregators}" --rule sd  # as published
