#!/usr/bin/env bash
# LongBench for one method and budget.
#
#   bash scripts/longbench/run.sh GPU METHOD BUDGET MODEL [run_longbench.py flags...]
#
#   GPU     CUDA device id(s), or "cpu";  BUDGET  tokens per layer and KV head (fullkv ignores it)
# Environment: DATASETS (the 16 English ones; space- or comma-separated), DATA_DIR (data/LongBench:
#   the official <dataset>.jsonl files), SAVE_DIR (results/longbench).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,8p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
GPU=$1 METHOD=$2 BUDGET=$3 MODEL=$4
shift 4
if [ "$GPU" != cpu ]; then export CUDA_VISIBLE_DEVICES=$GPU; fi
DATASETS=${DATASETS:-narrativeqa,qasper,multifieldqa_en,hotpotqa,2wikimqa,musique,gov_report,qmsum,multi_news,trec,triviaqa,samsum,passage_count,passage_retrieval_en,lcc,repobench-p}

# shellcheck disable=SC2086  # DATASETS may hold several space-separated names
"${PYTHON:-python}" run_longbench.py --model_path "$MODEL" --method "$METHOD" --max_capacity_prompts "$BUDGET" \
    --data_dir "${DATA_DIR:-data/LongBench}" --datasets $DATASETS --save_dir "${SAVE_DIR:-results/longbench}" "$@"
