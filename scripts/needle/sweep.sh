#!/usr/bin/env bash
# Needle-in-a-Haystack over budgets and methods, heatmaps, and the budget-vs-score figure.
#
#   bash scripts/needle/sweep.sh GPU MODEL [run_needle_in_haystack.py flags for every run...]
#
# Environment: BUDGETS ("64 128 256 512 1024"), the EXPERIMENTS table below, and run.sh's
#   S_LEN, E_LEN, STEP, DEPTHS, SAVE_DIR.
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 2
EXPERIMENTS=(snapkv "pyramidkv --window_size 8" streamingllm "$RESTKV_EXPERIMENT")
sweep_in_turn needle Needle "$@"
