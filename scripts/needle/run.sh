#!/usr/bin/env bash
# Needle-in-a-Haystack for one method and budget, then its heatmap.
#
#   bash scripts/needle/run.sh GPU METHOD BUDGET MODEL [run_needle_in_haystack.py flags...]
#
#   GPU     CUDA device id(s), or "cpu";  BUDGET  tokens per layer and KV head (fullkv ignores it)
# Environment: S_LEN (1000), E_LEN (8000), STEP (1000), DEPTHS (10 depth intervals),
#   SAVE_DIR (results/needle). The paper's grid: S_LEN=1000 E_LEN=32000 STEP=200.
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 4
run_method run_needle_in_haystack.py --s_len "${S_LEN:-1000}" --e_len "${E_LEN:-8000}" --step "${STEP:-1000}" \
    --depth_intervals "${DEPTHS:-10}" --save_dir "${SAVE_DIR:-results/needle}" -- "$@"
