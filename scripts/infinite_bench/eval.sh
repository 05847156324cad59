#!/usr/bin/env bash
# Score InfiniteBench runs: every run folder under RESULTS_DIR gets infinite_scores.json / .csv.
#
#   bash scripts/infinite_bench/eval.sh RESULTS_DIR      (e.g. results/infinite_bench/MODEL)
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 1 1
score_results eval_infinite.py "$1"
