#!/usr/bin/env bash
# InfiniteBench for one method and budget.
#
#   bash scripts/infinite_bench/run.sh GPU METHOD BUDGET MODEL [run_infinite_bench.py flags...]
#
#   GPU     CUDA device id(s), or "cpu";  BUDGET  tokens per layer and KV head (fullkv ignores it)
# Environment: TASKS (all 12; comma-separated), DATA_DIR (data/InfiniteBench: the HF dataset
#   xinrongzhang2022/InfiniteBench's <task>.jsonl files), SAVE_DIR (results/infinite_bench).
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 4
TASKS=${TASKS:-passkey,number_string,kv_retrieval,longbook_sum_eng,longbook_choice_eng,longbook_qa_eng,longbook_qa_chn,longdialogue_qa_eng,math_find,math_calc,code_run,code_debug}
run_method run_infinite_bench.py --data_dir "${DATA_DIR:-data/InfiniteBench}" --datasets "$TASKS" \
    --save_dir "${SAVE_DIR:-results/infinite_bench}" -- "$@"
