#!/usr/bin/env bash
# InfiniteBench over budgets and methods, then scores and the budget-vs-score figure.
# The ReST-KV paper's table (Llama-3.1-8B-Instruct): BUDGETS=1024, SnapKV vs ReST-KV with
# --kernel_size 21.
#
#   bash scripts/infinite_bench/sweep.sh GPU MODEL [run_infinite_bench.py flags for every run...]
#
# Environment: BUDGETS ("64 128 256 512 1024"), the EXPERIMENTS table below, and run.sh's
#   TASKS, DATA_DIR, SAVE_DIR.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,9p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
HERE=scripts/infinite_bench
GPU=$1 MODEL=$2
shift 2
BUDGETS=${BUDGETS:-64 128 256 512 1024}
EXPERIMENTS=(
    "snapkv"
    "restkv --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000 --kernel_size 21"
)
SAVE_DIR=${SAVE_DIR:-results/infinite_bench}
export SAVE_DIR

bash "$HERE/run.sh" "$GPU" fullkv 0 "$MODEL" "$@"
for budget in $BUDGETS; do
    for experiment in "${EXPERIMENTS[@]}"; do
        read -r method flags <<< "$experiment"
        # shellcheck disable=SC2086
        bash "$HERE/run.sh" "$GPU" "$method" "$budget" "$MODEL" $flags "$@"
    done
done
RESULTS=$SAVE_DIR/$(basename "$MODEL")
bash "$HERE/eval.sh" "$RESULTS"
"${PYTHON:-python}" visualization/visualize.py budget --results_root "$RESULTS" --title "InfiniteBench, $MODEL"
