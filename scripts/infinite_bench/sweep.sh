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
. "$(dirname "$0")/../common.sh"
require_args $# 2
EXPERIMENTS=(snapkv "$RESTKV_EXPERIMENT --kernel_size 21")
sweep_in_turn infinite_bench InfiniteBench "$@"
