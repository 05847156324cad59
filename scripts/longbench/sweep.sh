#!/usr/bin/env bash
# LongBench over budgets and methods (the ReST-KV paper's Table 2 layout), then scores: eval.sh writes
# the table of every run (SAVE_DIR/MODEL/score_table.csv, .json) and its figure (score_table.png).
# Each GPU of GPUS takes the next run; a run that finds its predictions skips them (resume).
#
#   bash scripts/longbench/sweep.sh "GPUS" MODEL [run_longbench.py flags for every run...]
#
#   GPUS    space-separated CUDA ids, e.g. "0 1 2 3", or "cpu"
# Environment: BUDGETS ("64 128 256 512 1024"), the EXPERIMENTS table below, and run.sh's
#   DATASETS, DATA_DIR, SAVE_DIR.
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 2
# "method extra-flags": one entry per method, run at every budget.
EXPERIMENTS=(streamingllm h2o snapkv pyramidkv "$RESTKV_EXPERIMENT")
sweep_across_gpus longbench "$@"
