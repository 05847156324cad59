#!/usr/bin/env bash
# RULER for one method and budget: generate the data for MODEL's tokenizer if missing, then run.
#
#   bash scripts/ruler/run.sh GPU METHOD BUDGET MODEL [run_ruler.py flags...]
#
#   GPU     CUDA device id(s) ("0", "0,1"), or "cpu"
#   METHOD  a restkv method (fullkv, snapkv, pyramidkv, restkv, ...)
#   BUDGET  tokens kept per layer and KV head (fullkv ignores it)
#   MODEL   smollm2-135m, gemma3-270m, a local folder or a hub id
# Environment: LENGTHS ("4096"), TASKS (the 11 synthetic tasks), NUM_SAMPLES (100),
#   DATA_DIR (data/RULER/<model name>: data are tokenizer-specific), SAVE_DIR (results/ruler).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,12p' "$0" >&2
    exit 2
fi
cd "$(dirname "$0")/../.."
GPU=$1 METHOD=$2 BUDGET=$3 MODEL=$4
shift 4
if [ "$GPU" != cpu ]; then export CUDA_VISIBLE_DEVICES=$GPU; fi
PYTHON=${PYTHON:-python}
LENGTHS=${LENGTHS:-4096}
TASKS=${TASKS:-niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe}
NUM_SAMPLES=${NUM_SAMPLES:-100}
DATA_DIR=${DATA_DIR:-data/RULER/$(basename "$MODEL")}
SAVE_DIR=${SAVE_DIR:-results/ruler}

# shellcheck disable=SC2086  # LENGTHS is a list
"$PYTHON" -m restkv.benchmarks.ruler_data --tokenizer "$MODEL" --lengths $LENGTHS --tasks "$TASKS" \
    --num_samples "$NUM_SAMPLES" --out "$DATA_DIR"
# shellcheck disable=SC2086
"$PYTHON" run_ruler.py --model_path "$MODEL" --method "$METHOD" --max_capacity_prompts "$BUDGET" \
    --data_dir "$DATA_DIR" --context_lengths $LENGTHS --datasets "$TASKS" \
    --max_num_examples "$NUM_SAMPLES" --save_dir "$SAVE_DIR" "$@"
