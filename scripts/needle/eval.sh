#!/usr/bin/env bash
# Heatmaps of needle runs: every needle_results.json under RESULTS_DIR gets needle_heatmap.png.
#
#   bash scripts/needle/eval.sh RESULTS_DIR [visualize.py needle flags, e.g. --pretrained_length 8192]
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 1
RESULTS_DIR=$(cd "$1" && pwd)  # relative to the caller, before moving to the repository root
shift
cd "$REPO_ROOT"
found=0
while IFS= read -r -d '' results; do
    "${PYTHON:-python}" visualization/visualize.py needle --results "$results" "$@"
    found=1
done < <(find "$RESULTS_DIR" -name needle_results.json -print0 | sort -z)
if [ "$found" = 0 ]; then
    echo "no needle_results.json under $RESULTS_DIR" >&2
    exit 1
fi
