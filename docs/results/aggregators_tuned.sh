#!/usr/bin/env bash
# The tuned aggregator comparison (issue 14; protocol and cost: docs/compare.md, "A comparison
# a reviewer would accept"). Nano model, embedded Python code (stdlib + torch sources), CPU,
# two cells at a time with one thread each. Every stage is an ordinary `mloco compare` folder:
# rerun this script to resume (finished cells are skipped); it stops where a decision cannot be
# made yet (a curve that is not flat, an optimum on a grid edge) and says what to extend.
# Usage: bash docs/results/aggregators_tuned.sh [WORK_DIR]
# On a machine without the work folder, resume from the published data first (its finished
# cells are then skipped): python docs/results/aggregators_tuned.py restore \
#   docs/results/aggregators_tuned WORK_DIR
set -euo pipefail
export OMP_NUM_THREADS=1
WORK="${1:-results/aggregators_tuned}"
mkdir -p "$WORK/inner"  # mloco creates its outputs, not the folders above them
HERE="$(cd "$(dirname "$0")" && pwd)"
decide() { python "$HERE/aggregators_tuned.py" "$@"; }

TUNING_SEED="900,"     # used for every choice below, never reported
REPORT_SEEDS="0,1,2"
AGGREGATORS=diloco,diloco-sgd,isoloco,isoloco-ns,isoc-sgd,tsv,ties,iso-cts
# One validation set for every seed and cell: 8 x 32,768 held-out tokens, by --val-seed.
# stdlib alone holds 3.0M training tokens, too few for DiLoCo's curve to flatten (measured:
# docs/results/aggregators_tuned.md); with the pinned torch package's sources, 16.9M.
SHAPE="--model nano --data stdlib,torchsrc --global-batch 16 --seq-len 128 --inner-steps 10"
# A checkpoint every 20 rounds (about 1.5 min of a cell): a session's end costs little.
SHARED="$SHAPE --val-seed 1000 --val-tokens 262144 --checkpoint-every 20 --jobs 2"
HORIZON_TOKENS="${HORIZON_TOKENS:-16384000}"    # 800 rounds of H = 10 x 16 x 128
INNER_LRS="${INNER_LRS:-5e-4 1e-3 2e-3 4e-3}"
WEIGHT_DECAY=0.1
# Multiples of each preset's outer lr, and outer momenta (presets with momentum only). To
# extend one aggregator's grid, add a space and its own values (absolute, as cell names print
# them, so finished cells are reused): each word is one --outer-lr-grid option. diloco's grid
# was extended one step down in lr (0.354 x 0.7) and momentum (0.7) during stage 4, when its
# R = 2 cells put the best setting on both low edges, then in momentum again (0.6, then 0.5,
# then 0.4), each time R = 2's best stayed on the momentum edge; diloco-sgd's one step down in
# lr (0.568 = 0.8 x 0.71), when R = 2's best lay on its low edge; isoloco's one step down in lr
# (0.639 = 0.9 x 0.71) and momentum (0.7), when its R = 2 cells put the best on both low edges,
# then in momentum again (0.6, then 0.5, then 0.4), each time R = 2's best moved to the new lowest
# momentum (docs/results/aggregators_tuned.md).
OUTER_LR_GRID="${OUTER_LR_GRID:-0.5,0.71,1,1.41,2 diloco=0.248,0.35,0.497,0.7,0.987,1.4
  diloco-sgd=0.568,0.8,1.136,1.6,2.256,3.2 isoloco=0.639,0.9,1.278,1.8,2.538,3.6}"
MOMENTUM_GRID="${MOMENTUM_GRID:-0.8,0.9,0.95 diloco=0.4,0.5,0.6,0.7,0.8,0.9,0.95
  isoloco=0.4,0.5,0.6,0.7,0.8,0.9,0.95}"
GRIDS=()
for spec in $OUTER_LR_GRID; do GRIDS+=(--outer-lr-grid "$spec"); done
for spec in $MOMENTUM_GRID; do GRIDS+=(--outer-momentum-grid "$spec"); done

# 1. Horizon: DiLoCo (presets' values, R = 8) and the baseline on a long budget, validated
#    every 20 rounds; the budget is where doubling the tokens gains < 0.05 nats.
mloco compare --aggregators diloco --workers 8 --seeds "$TUNING_SEED" $SHARED \
  --tokens "$HORIZON_TOKENS" --eval-every 20 -o "$WORK/horizon"
TOKENS=$(decide horizon "$WORK/horizon")

# 2. Evaluation noise: the baseline's and DiLoCo's final models on the 8 disjoint 32,768-token
#    parts of the shared validation set; the sd / sqrt(8) of their per-part difference is the
#    noise of one paired comparison on the whole set (printed, saved in the horizon stage's
#    eval_noise.json). Measured once: a rerun reuses it (a work folder restored from the
#    published data has it, and not the final models it was measured on).
NOISE="$WORK/horizon/eval_noise.json"
if [[ ! -s "$NOISE" ]]; then
  mloco eval "$WORK/horizon/runs/dp-s${TUNING_SEED%,}/final" \
    "$WORK/horizon/runs/diloco-R8-H10-s${TUNING_SEED%,}/final" --data stdlib+torchsrc \
    --tokens 32768 --val-sets 8 --seed 1000 --json > "$NOISE.tmp"
  mv "$NOISE.tmp" "$NOISE"
fi
decide noise "$NOISE"

# 3. One inner AdamW setting for every aggregator: the lr best for dp and DiLoCo (R = 2, 8).
#    Each lr is its own sweep of 3 cells; two streams of sweeps, one job each, keep both
#    cores busy (one sweep with --jobs 2 would leave a core idle for its third cell).
inner_sweeps() {
  for lr in "$@"; do
    mloco compare --aggregators diloco --workers 2,8 --seeds "$TUNING_SEED" $SHARED \
      --jobs 1 --tokens "$TOKENS" --inner-lr "$lr" --weight-decay "$WEIGHT_DECAY" \
      -o "$WORK/inner/lr$lr"
  done
}
read -r -a LRS <<< "$INNER_LRS"
EVEN=() ODD=() INNER_DIRS=()
for i in "${!LRS[@]}"; do
  if (( i % 2 )); then ODD+=("${LRS[i]}"); else EVEN+=("${LRS[i]}"); fi
  INNER_DIRS+=("$WORK/inner/lr${LRS[i]}")
done
inner_sweeps "${EVEN[@]}" & first=$!
inner_sweeps "${ODD[@]}" & second=$!
failed=0
wait "$first" || failed=1
wait "$second" || failed=1
if (( failed )); then echo "an inner-lr sweep failed; rerun this script to resume" >&2; exit 1; fi
INNER_LR=$(decide inner "${INNER_DIRS[@]}")
INNER="--inner-lr $INNER_LR --weight-decay $WEIGHT_DECAY"

# 4. Outer lr (and momentum) of every aggregator on a grid at R = 2 and 8, the tuning seed.
#    Chosen on final losses only, so cells validate only at the end (7% of a cell's time); no
#    baseline cell (stage 3 ran dp at this inner lr).
mloco compare --aggregators "$AGGREGATORS" --workers 2,8 --seeds "$TUNING_SEED" $SHARED \
  --tokens "$TOKENS" $INNER --eval-every 0 --no-baseline "${GRIDS[@]}" -o "$WORK/tune"
TUNED=$(decide flags "$WORK/tune" --aggregators "$AGGREGATORS")
decide table "$WORK/tune" > "$WORK/tune/tuned.md"

# 5. The report: every aggregator at its tuned values, R = 2..16, three seeds, the baseline.
# shellcheck disable=SC2086
mloco compare --aggregators "$AGGREGATORS" --workers 2,4,8,16 --seeds "$REPORT_SEEDS" \
  $SHARED --tokens "$TOKENS" $INNER $TUNED -o "$WORK/report"
mloco report "$WORK/report"
python "$HERE/aggregator_claims.py" "$WORK/report" --seeds "$REPORT_SEEDS"
python "$HERE/aggregator_claims.py" "$WORK/report" --seeds "$REPORT_SEEDS" --markdown \
  > "$WORK/report/claims.md"

# 6. Doubling check: the claims' core cells (averaging and Iso-C, with and without momentum)
#    at twice the budget, same tuned values and seeds: do the verdicts of stage 5 hold when
#    training goes twice as far? (With T at half the data, still no token is seen twice.)
DOUBLED=diloco,diloco-sgd,isoloco,isoc-sgd
TUNED_DOUBLED=$(decide flags "$WORK/tune" --aggregators "$DOUBLED")
# shellcheck disable=SC2086
mloco compare --aggregators "$DOUBLED" --workers 2,8 --seeds "$REPORT_SEEDS" $SHARED \
  --tokens $((2 * TOKENS)) $INNER $TUNED_DOUBLED -o "$WORK/doubling"
python "$HERE/aggregator_claims.py" "$WORK/doubling" --seeds "$REPORT_SEEDS"
python "$HERE/aggregator_claims.py" "$WORK/doubling" --seeds "$REPORT_SEEDS" --markdown \
  > "$WORK/doubling/claims.md"
