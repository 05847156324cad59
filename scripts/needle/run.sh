#!/usr/bin/env bash
# Needle-in-a-Haystack for one method and budget, then its heatmap.
#
#   bash scripts/needle/run.sh GPU METHOD BUDGET MODEL [run_needle_in_haystack.py flags...]
#
#   GPU     CUDA device id(s), or "cpu";  BUDGET  tokens per layer and KV head (fullkv ignores it)
# Environment: S_LEN (1000), E_LEN (8000), STEP (1000), DEPTHS (10 depth intervals),
#   SAVE_DIR (results/needle). The paper's grid: S_LEN=1000 E_LEN=32000 STEP=200.
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,8p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
GPU=$1 METHOD=$2 BUDGET=$3 MODEL=$4
shift 4
if [ "$GPU" != cpu ]; then export CUDA_VISIBLE_DEVICES=$GPU; fi
PYTHON=${PYTHON:-python}
SAVE_DIR=${SAVE_DIR:-results/needle}

"$PYTHON" run_needle_in_haystack.py --model_path "$MODEL" --method "$METHOD" --max_capacity_prompts "$BUDGET" \
    --s_len "${S_LEN:-1000}" --e_len "${E_LEN:-8000}" --step "${STEP:-1000}" --depth_intervals "${DEPTHS:-10}" \
    --save_dir "$SAVE_DIR" "$@"
