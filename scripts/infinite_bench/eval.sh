#!/usr/bin/env bash
# Score InfiniteBench runs: every run folder under RESULTS_DIR gets infinite_scores.json / .csv.
#
#   bash scripts/infinite_bench/eval.sh RESULTS_DIR      (e.g. results/infinite_bench/MODEL)
set -euo pipefail
if [ $# -ne 1 ]; then
    sed -n '2,4p' "$0" >&2
    exit 2
fi
RESULTS_DIR=$(cd "$1" && pwd)  # relative to the caller, before moving to the repository root
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" eval_infinite.py --results_dir "$RESULTS_DIR"
