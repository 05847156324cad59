#!/usr/bin/env bash
# RULER over budgets and methods, then scores (eval.sh: the table of every run and its figure,
# score vs share of the cache kept) and the budget-vs-score figure.
#
#   bash scripts/ruler/sweep.sh GPU MODEL [run_ruler.py flags for every run...]
#
# Environment: BUDGETS ("64 128 256 512 1024"); the EXPERIMENTS table below (method and its
#   flags; fullkv runs once); plus run.sh's LENGTHS, TASKS, NUM_SAMPLES, DATA_DIR, SAVE_DIR.
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 2
EXPERIMENTS=(snapkv pyramidkv streamingllm "$RESTKV_EXPERIMENT")  # "method flags", run at every budget
sweep_in_turn ruler RULER "$@"
