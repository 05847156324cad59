#!/usr/bin/env bash
# Score RULER runs: every run folder under RESULTS_DIR gets ruler_scores.json / .csv.
#
#   bash scripts/ruler/eval.sh RESULTS_DIR      (e.g. results/ruler/smollm2-135m)
set -euo pipefail
if [ $# -ne 1 ]; then
    sed -n '2,4p' "$0" >&2
    exit 2
fi
RESULTS_DIR=$(cd "$1" && pwd)  # relative to the caller, before moving to the repository root
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" eval_ruler.py --results_dir "$RESULTS_DIR"
