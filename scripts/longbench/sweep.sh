#!/usr/bin/env bash
# LongBench over budgets and methods (the ReST-KV paper's Table 2 layout), then scores.
# Each GPU of GPUS takes the next run; a run that finds its predictions skips them (resume).
#
#   bash scripts/longbench/sweep.sh "GPUS" MODEL [run_longbench.py flags for every run...]
#
#   GPUS    space-separated CUDA ids, e.g. "0 1 2 3", or "cpu"
# Environment: BUDGETS ("64 128 256 512 1024"), the EXPERIMENTS table below, and run.sh's
#   DATASETS, DATA_DIR, SAVE_DIR.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n '2,9p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
HERE=scripts/longbench
read -r -a GPUS <<< "$1"
MODEL=$2
shift 2
BUDGETS=${BUDGETS:-64 128 256 512 1024}
# "method extra-flags": one line per method, run at every budget.
EXPERIMENTS=(
    "streamingllm"
    "h2o"
    "snapkv"
    "pyramidkv"
    "restkv --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000"
)
SAVE_DIR=${SAVE_DIR:-results/longbench}
export SAVE_DIR

RUNS=("fullkv 0")
for budget in $BUDGETS; do
    for experiment in "${EXPERIMENTS[@]}"; do
        read -r method flags <<< "$experiment"
        RUNS+=("$method $budget $flags")
    done
done

failed=0
pids=()
wait_all() {
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    pids=()
}
for entry in "${RUNS[@]}"; do
    read -r method budget flags <<< "$entry"
    # shellcheck disable=SC2086
    bash "$HERE/run.sh" "${GPUS[${#pids[@]}]}" "$method" "$budget" "$MODEL" $flags "$@" &
    pids+=($!)
    if [ "${#pids[@]}" -eq "${#GPUS[@]}" ]; then wait_all; fi
done
wait_all
bash "$HERE/eval.sh" "$SAVE_DIR/$(basename "$MODEL")"
if [ "$failed" -ne 0 ]; then
    echo "some runs failed (see their output above); rerun the sweep to resume them" >&2
    exit 1
fi
