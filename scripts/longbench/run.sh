#!/usr/bin/env bash
# LongBench for one method and budget.
#
#   bash scripts/longbench/run.sh GPU METHOD BUDGET MODEL [run_longbench.py flags...]
#
#   GPU     CUDA device id(s), or "cpu";  BUDGET  tokens per layer and KV head (fullkv ignores it)
# Environment: DATASETS (the 16 English ones; space- or comma-separated), DATA_DIR (data/LongBench:
#   the official <dataset>.jsonl files), SAVE_DIR (results/longbench).
set -euo pipefail
. "$(dirname "$0")/../common.sh"
require_args $# 4
DATASETS=${DATASETS:-narrativeqa,qasper,multifieldqa_en,hotpotqa,2wikimqa,musique,gov_report,qmsum,multi_news,trec,triviaqa,samsum,passage_count,passage_retrieval_en,lcc,repobench-p}
# shellcheck disable=SC2086  # DATASETS may hold several space-separated names
run_method run_longbench.py --data_dir "${DATA_DIR:-data/LongBench}" --datasets $DATASETS \
    --save_dir "${SAVE_DIR:-results/longbench}" -- "$@"
