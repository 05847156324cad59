#!/usr/bin/env bash
# Score LongBench runs: every run folder under RESULTS_DIR gets metrics.json; RESULTS_DIR gets
# results.json and results.csv (one row per run, the 16-dataset average last), and every run as one
# table, score_table.csv / .json, with its figure score_table.png (score vs share of the cache kept).
#
#   bash scripts/longbench/eval.sh RESULTS_DIR [eval.py flags...]      (e.g. results/longbench/MODEL)
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 1
score_results eval.py "$@"
