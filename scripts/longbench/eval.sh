#!/usr/bin/env bash
# Score LongBench runs: every run folder under RESULTS_DIR gets metrics.json; RESULTS_DIR gets
# results.json and results.csv (one row per run, the 16-dataset average last).
#
#   bash scripts/longbench/eval.sh RESULTS_DIR [eval.py flags...]      (e.g. results/longbench/MODEL)
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,5p' "$0" >&2
    exit 2
fi
RESULTS_DIR=$(cd "$1" && pwd)  # relative to the caller, before moving to the repository root
shift
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" eval.py --results_dir "$RESULTS_DIR" "$@"
