#!/usr/bin/env bash
# Heatmaps of needle runs: every needle_results.json under RESULTS_DIR gets needle_heatmap.png.
#
#   bash scripts/needle/eval.sh RESULTS_DIR [visualize.py needle flags, e.g. --pretrained_length 8192]
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n '2,4p' "$0" >&2
    exit 2
fi
RESULTS_DIR=$(cd "$1" && pwd)  # relative to the caller, before moving to the repository root
shift
cd "$(dirname "$0")/../.."
found=0
while IFS= read -r -d '' results; do
    "${PYTHON:-python}" visualization/visualize.py needle --results "$results" "$@"
    found=1
done < <(find "$RESULTS_DIR" -name needle_results.json -print0 | sort -z)
if [ "$found" = 0 ]; then
    echo "no needle_results.json under $RESULTS_DIR" >&2
    exit 1
fi
