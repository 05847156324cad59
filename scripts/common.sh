# What scripts/<benchmark>/{run,eval,sweep}.sh share; they source it, it is not run alone.
# A script keeps its usage (its leading comment block), its runner and its benchmark's flags,
# and leaves the rest to these functions. PYTHON (default: python) runs the Python scripts.

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The ReST-KV paper's settings of its own method: the restkv line of every sweep's EXPERIMENTS.
RESTKV_EXPERIMENT="restkv --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000"

# require_args COUNT MIN [MAX]: with fewer than MIN (or more than MAX) arguments, print the calling
# script's usage, the comment block under its first line, to stderr and exit 2.
require_args() {
    local count=$1 min=$2 max=${3:-$1}
    if [ "$count" -lt "$min" ] || [ "$count" -gt "$max" ]; then
        awk 'NR > 1 { if (!/^#/) exit; print }' "$0" >&2
        exit 2
    fi
}

# use_gpu GPU: make CUDA device id(s) GPU the visible ones; "cpu" leaves the environment alone.
use_gpu() {
    if [ "$1" != cpu ]; then export CUDA_VISIBLE_DEVICES=$1; fi
}

# run_method RUNNER [BENCHMARK FLAGS...] -- GPU METHOD BUDGET MODEL [FLAGS...]: one run_*.py call
# for one method and budget, from the repository root; FLAGS come last, so they override.
run_method() {
    local runner=$1
    local -a benchmark_flags=()
    shift
    while [ "$1" != -- ]; do
        benchmark_flags+=("$1")
        shift
    done
    shift
    local gpu=$1 method=$2 budget=$3 model=$4
    shift 4
    use_gpu "$gpu"
    cd "$REPO_ROOT"
    "${PYTHON:-python}" "$runner" --model_path "$model" --method "$method" --max_capacity_prompts "$budget" \
        "${benchmark_flags[@]}" "$@"
}

# score_results EVAL_SCRIPT RESULTS_DIR [FLAGS...]: an eval*.py over RESULTS_DIR, which is
# relative to the caller's folder (resolved before moving to the repository root).
score_results() {
    local eval_script=$1 results_dir
    results_dir=$(cd "$2" && pwd)
    shift 2
    cd "$REPO_ROOT"
    "${PYTHON:-python}" "$eval_script" --results_dir "$results_dir" "$@"
}

# prepare_sweep BENCHMARK: move to the repository root, export SAVE_DIR (default results/BENCHMARK)
# for run.sh and eval.sh, and fill RUNS with "method budget flags" entries: fullkv once, then
# every EXPERIMENTS line ("method flags") at every budget of BUDGETS (default "64 128 256 512 1024").
prepare_sweep() {
    local benchmark=$1 budget experiment method flags
    cd "$REPO_ROOT"
    export SAVE_DIR=${SAVE_DIR:-results/$benchmark}
    RUNS=("fullkv 0")
    for budget in ${BUDGETS:-64 128 256 512 1024}; do
        for experiment in "${EXPERIMENTS[@]}"; do
            read -r method flags <<< "$experiment"
            RUNS+=("$method $budget $flags")
        done
    done
}

# sweep_in_turn BENCHMARK TITLE GPU MODEL [FLAGS...]: scripts/BENCHMARK/run.sh for every sweep run,
# one after the other (the first failure stops the sweep), then its eval.sh, then the
# budget-vs-score figure titled "TITLE, MODEL". Results go to SAVE_DIR (results/BENCHMARK).
sweep_in_turn() {
    local benchmark=$1 title=$2 gpu=$3 model=$4 entry method budget flags
    shift 4
    prepare_sweep "$benchmark"
    for entry in "${RUNS[@]}"; do
        read -r method budget flags <<< "$entry"
        # shellcheck disable=SC2086  # flags is a list
        bash "scripts/$benchmark/run.sh" "$gpu" "$method" "$budget" "$model" $flags "$@"
    done
    local results
    results=$SAVE_DIR/$(basename "$model")
    bash "scripts/$benchmark/eval.sh" "$results"
    "${PYTHON:-python}" visualization/visualize.py budget --results_root "$results" --title "$title, $model"
}

# wait_for PID...: wait for every process; fails if any of them failed.
wait_for() {
    local pid status=0
    for pid in "$@"; do wait "$pid" || status=1; done
    return "$status"
}

# sweep_across_gpus BENCHMARK "GPUS" MODEL [FLAGS...]: scripts/BENCHMARK/run.sh for every sweep run,
# each GPU of GPUS taking the next one; failed runs do not stop the others. Then eval.sh, and exit
# 1 if any run failed. Results go to SAVE_DIR (results/BENCHMARK).
sweep_across_gpus() {
    local benchmark=$1 model=$3 entry method budget flags failed=0
    local -a gpus pids=()
    read -r -a gpus <<< "$2"
    shift 3
    prepare_sweep "$benchmark"
    for entry in "${RUNS[@]}"; do
        read -r method budget flags <<< "$entry"
        # shellcheck disable=SC2086  # flags is a list
        bash "scripts/$benchmark/run.sh" "${gpus[${#pids[@]}]}" "$method" "$budget" "$model" $flags "$@" &
        pids+=($!)
        if [ "${#pids[@]}" -eq "${#gpus[@]}" ]; then
            wait_for "${pids[@]}" || failed=1
            pids=()
        fi
    done
    wait_for "${pids[@]}" || failed=1
    bash "scripts/$benchmark/eval.sh" "$SAVE_DIR/$(basename "$model")"
    if [ "$failed" -ne 0 ]; then
        echo "some runs failed (see their output above); rerun the sweep to resume them" >&2
        exit 1
    fi
}
