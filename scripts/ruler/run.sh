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
. "$(dirname "$0")/../common.sh"
require_args $# 4
MODEL=$4
LENGTHS=${LENGTHS:-4096}
TASKS=${TASKS:-niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe}
NUM_SAMPLES=${NUM_SAMPLES:-100}
DATA_DIR=${DATA_DIR:-data/RULER/$(basename "$MODEL")}

use_gpu "$1"
cd "$REPO_ROOT"
# shellcheck disable=SC2086  # LENGTHS is a list
"${PYTHON:-python}" -m restkv.benchmarks.ruler_data --tokenizer "$MODEL" --lengths $LENGTHS --tasks "$TASKS" \
    --num_samples "$NUM_SAMPLES" --out "$DATA_DIR"
# shellcheck disable=SC2086
run_method run_ruler.py --data_dir "$DATA_DIR" --context_lengths $LENGTHS --datasets "$TASKS" \
    --max_num_examples "$NUM_SAMPLES" --save_dir "${SAVE_DIR:-results/ruler}" -- "$@"
