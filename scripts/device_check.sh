#!/usr/bin/env bash
# The GPU checks in one run, within about 8 minutes on one GPU (an H200 or an H100):
#   1. pytest -m cuda: flash_attention_2 and sdpa exactness, flash compresses what sdpa
#      compresses, the ResKV log-sum-exp combination on CUDA tensors (tests/test_cuda.py);
#   2. scripts/gpu_bench.py with Llama-3.1-8B's shape at 32K and 128K tokens for fullkv, snapkv
#      and restkv (budget 1024, 2 interleaved repeats, 128 decode steps);
#   3. the same benchmark for the stored segments against SnapKV (KIVI 4-bit codes, ThinK's pruned
#      keys, ResKV's entries, MomentKV's entry, AdaKV's ragged heads), with flash_attention_2 where
#      flash-attn imports (else sdpa), one repeat (segments.log, segments.json);
#   4. where a CUDA vLLM environment is there (VLLM_PYTHON, default .venv-vllm/bin/python with vllm and
#      CUDA), scripts/vllm_bench.py --check: plain vLLM against vLLM + restkv snapkv at 10% kept
#      (vllm_bench.log); skipped with a line in the summary otherwise.
# Everything lands in the output folder: pytest_cuda.log, gpu_bench.log, gpu_bench.json, segments.json (rows for
# `visualization/visualize.py efficiency`) and summary.txt (the tables, ratios vs SnapKV and vs
# the full cache).
#
#   bash scripts/device_check.sh [OUT_DIR]      OUT_DIR defaults to $OUT, else results/device_check
#
#   PYTHON        the interpreter (default .venv/bin/python; without one, scripts/setup.sh makes
#                 it, so set TORCH_SPEC to a CUDA build and EXTRAS="bench,test,flash" then)
#   WHEELS        a folder of wheels installed first, offline, into a scratch folder (for a
#                 machine that reaches no package index: e.g. transformers 5.24 and flash-attn)
#   DEVICE_CHECK_TINY=1   the same steps on the CPU with the tiny model shape, in seconds (the
#                 CUDA tests skip, and so does the vLLM step): a dry run of this script (tests/test_gpu_bench.py)
#   VLLM_PYTHON   the interpreter of an environment with CUDA vLLM and restkv (e.g. made by
#                 TORCH_SPEC=... VLLM_EXTRA=vllm bash scripts/setup_vllm.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-${OUT:-results/device_check}}
mkdir -p "$out"
if [ -z "${PYTHON:-}" ]; then
    [ -x .venv/bin/python ] || bash scripts/setup.sh
    PYTHON=.venv/bin/python
fi
if [ -n "${WHEELS:-}" ]; then
    site=$(mktemp -d)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# This checkout's restkv, whether or not it is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "${DEVICE_CHECK_TINY:-0}" = 1 ]; then
    bench=(--config tiny --device cpu --lengths 160 288 --budget 64 --decode_steps 4 --repeats 1)
    segments=(--config tiny --device cpu --lengths 288 --budget 64 --decode_steps 4 --repeats 1)
else
    "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible to torch")'
    bench=(--config llama-8b --lengths 32768 131072 --budget 1024 --decode_steps 128 --repeats 2)
    segments=(--config llama-8b --lengths 32768 131072 --budget 1024 --decode_steps 128 --repeats 1)
    if "$PYTHON" -c 'import flash_attn' 2>/dev/null; then
        segments+=(--attn_implementation flash_attention_2)
    fi
fi

failed=0
"$PYTHON" -m pytest -m cuda -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log" \
    || failed=1
"$PYTHON" scripts/gpu_bench.py "${bench[@]}" --methods fullkv snapkv restkv --out "$out/gpu_bench.json" \
    --summary "$out/summary.txt" 2>&1 | tee "$out/gpu_bench.log" || failed=1
"$PYTHON" scripts/gpu_bench.py "${segments[@]}" --methods snapkv snapkv+quant_method=kivi+nbits=4 snapkv+think \
    snapkv+residual momentkv adakv --out "$out/segments.json" --summary "$out/segments.txt" 2>&1 \
    | tee "$out/segments.log" || failed=1
[ -f "$out/segments.txt" ] && cat "$out/segments.txt" >> "$out/summary.txt"
vllm_python=${VLLM_PYTHON:-.venv-vllm/bin/python}
if [ "${DEVICE_CHECK_TINY:-0}" != 1 ] && [ -x "$vllm_python" ] \
        && "$vllm_python" -c 'import sys, torch, vllm; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$vllm_python" scripts/vllm_bench.py --method snapkv --compression_ratio 0.9 --check 2>&1 \
        | tee "$out/vllm_bench.log" || failed=1
    grep '^vllm:' "$out/vllm_bench.log" >> "$out/summary.txt" || true
else
    echo "vllm: skipped (no CUDA vLLM environment at $vllm_python)" >> "$out/summary.txt"
fi
[ -f "$out/summary.txt" ] && cat "$out/summary.txt"
if [ "$failed" = 1 ]; then
    echo "device check: a step failed (see $out/pytest_cuda.log, $out/gpu_bench.log, $out/segments.log," \
        "$out/vllm_bench.log)" >&2
fi
exit "$failed"
