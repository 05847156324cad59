#!/usr/bin/env bash
# Score RULER runs: every run folder under RESULTS_DIR gets ruler_scores.json / .csv; RESULTS_DIR gets
# every run as one table, score_table.csv / .json, and its figure score_table.png.
#
#   bash scripts/ruler/eval.sh RESULTS_DIR      (e.g. results/ruler/smollm2-135m)
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 1 1
score_results eval_ruler.py "$1"
