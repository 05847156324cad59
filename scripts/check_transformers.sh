#!/usr/bin/env bash
# Run restkv's exactness tests against another transformers release, in a scratch environment
# (the project's .venv is left alone):
#
#   bash scripts/check_transformers.sh 5.25.0            # the exactness tests
#   bash scripts/check_transformers.sh 5.22.0 -k gemma   # extra arguments go to pytest
#
#   TORCH_SPEC     what to install for PyTorch (default "torch==2.13.0")
#   CHECK_ENV_DIR  where the scratch environment goes (default: a new temporary folder, removed after)
#
# A release older than restkv's oldest supported one is tried too (RESTKV_TRANSFORMERS_CHECK=warn);
# the exit status is pytest's.
set -euo pipefail
VERSION=${1:?usage: bash scripts/check_transformers.sh VERSION [pytest arguments]}
shift
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ -n "${CHECK_ENV_DIR:-}" ]; then
    ENV_DIR=$CHECK_ENV_DIR
else
    SCRATCH=$(mktemp -d)
    trap 'rm -rf "$SCRATCH"' EXIT
    ENV_DIR=$SCRATCH/venv
fi
[ -x "$ENV_DIR/bin/python" ] || "$PYTHON" -m venv "$ENV_DIR"
pip() { "$ENV_DIR/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install $TORCH_SPEC
# This checkout (editable: nothing is built in it) with the asked-for transformers.
pip install -e ".[test]" "transformers==$VERSION"
echo "checking restkv against transformers $("$ENV_DIR/bin/python" -c 'import transformers; print(transformers.__version__)')"
HF_HUB_OFFLINE=1 RESTKV_TRANSFORMERS_CHECK=warn RESTKV_CACHE_DIR=$(mktemp -d) \
    "$ENV_DIR/bin/python" -m pytest -q -p no:cacheprovider \
    tests/integrations/test_model_exactness.py tests/integrations/test_monkeypatch.py tests/integrations/test_positions.py tests/integrations/test_batches.py \
    tests/pipeline/test_chunked.py "$@"
