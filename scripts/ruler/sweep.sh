#!/usr/bin/env bash
# RULER over budgets and methods, then scores and the budget-vs-score figure.
#
#   bash scripts/ruler/sweep.sh GPU MODEL [run_ruler.py flags for every run...]
#
# Environment: BUDGETS ("64 128 256 512 1024"); the EXPERIMENTS table below (method and its
#   flags; fullkv runs once); plus run.sh's LENGTHS, TASKS, NUM_SAMPLES, DATA_DIR, SAVE_DIR.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,7p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
HERE=scripts/ruler
GPU=$1 MODEL=$2
shift 2
BUDGETS=${BUDGETS:-64 128 256 512 1024}
EXPERIMENTS=(
    "snapkv"
    "pyramidkv"
    "streamingllm"
    "restkv --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000"
)
SAVE_DIR=${SAVE_DIR:-results/ruler}
export SAVE_DIR

bash "$HERE/run.sh" "$GPU" fullkv 0 "$MODEL" "$@"
for budget in $BUDGETS; do
    for experiment in "${EXPERIMENTS[@]}"; do
        read -r method flags <<< "$experiment"
        # shellcheck disable=SC2086  # flags is a list
        bash "$HERE/run.sh" "$GPU" "$method" "$budget" "$MODEL" $flags "$@"
    done
done
RESULTS=$SAVE_DIR/$(basename "$MODEL")
bash "$HERE/eval.sh" "$RESULTS"
"${PYTHON:-python}" visualization/visualize.py budget --results_root "$RESULTS" --title "RULER, $MODEL"
