"""scripts/gpu_bench.py and scripts/device_check.sh on the CPU: the tiny shape runs the GPU
benchmark's code path in seconds; the model shapes are the published models'."""

import json
import os
import subprocess
import sys

import pytest
import torch
from top_level import ROOT, load_script, load_scripts_module


@pytest.fixture(scope="module")
def bench():
    """scripts/gpu_bench.py as a module (scripts/ is no package)."""
    return load_scripts_module("gpu_bench")


@pytest.mark.parametrize("name, parameters", [("llama-8b", 8_030_261_248), ("mistral-7b", 7_248_023_552),
                                              ("qwen2-7b", 7_615_616_512)])
def test_model_shapes_have_the_published_parameter_counts(bench, name, parameters):
    model = bench.build_model(name, torch.bfloat16, torch.device("meta"), "sdpa", 131072)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert {p.device.type for p in model.parameters()} == {"meta"}  # built where asked, nothing on the host


def test_the_model_is_initialised_on_its_device_in_its_dtype(bench):
    model = bench.build_model("tiny", torch.bfloat16, torch.device("cpu"), "sdpa", 512)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.bfloat16 and 0.01 < float(weight.detach().float().std()) < 0.03  # initializer_range 0.02


def test_tiny_run_writes_rows_for_the_efficiency_figure_with_ratios_to_snapkv_and_fullkv(bench, tmp_path, capsys):
    out, summary = tmp_path / "bench.json", tmp_path / "summary.txt"
    rows = bench.main(["--config", "tiny", "--device", "cpu", "--lengths", "160", "--budget", "48",
                       "--decode_steps", "2", "--repeats", "2", "--methods", "fullkv", "snapkv", "restkv",
                       "snapkv+residual", "--out", str(out), "--summary", str(summary)])
    assert json.loads(out.read_text()) == rows
    by_method = {row["method"]: row for row in rows}
    assert list(by_method) == ["fullkv", "snapkv", "restkv", "snapkv+residual"]
    full = by_method["fullkv"]
    assert full["budget"] is None and full["kept_share"] == 1.0
    for name in ("snapkv", "restkv", "snapkv+residual"):
        row = by_method[name]
        assert row["budget"] == 48 and row["prompt_tokens"] == 160 and len(row["runs"]) == 2
        assert row["kept_share"] < 0.4 and row["cache_bytes"] < full["cache_bytes"] / 2
        assert row["prefill_s"] > 0 and row["decode_s_per_token"] > 0
        assert row["device"] == "cpu" and row["config"] == "tiny" and row["dtype"] == "float32"
        assert "peak_memory_bytes" not in row  # on a CPU only the cache report's bytes are known
    text = summary.read_text()
    assert "(ratios vs snapkv)" in text and "(ratios vs fullkv)" in text
    assert "(ratios vs fullkv)" in capsys.readouterr().out

    figure = load_script("visualization.figures").efficiency_plot(rows, tmp_path / "bench.png")
    assert {line.get_label() for line in figure.axes[0].get_lines()} == set(by_method)




def test_device_check_dry_run_on_the_cpu_leaves_logs_json_and_a_summary(tmp_path):
    env = {**os.environ, "DEVICE_CHECK_TINY": "1", "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_bench.json", "gpu_bench.log", "pytest_cuda.log",
                                                           "segments.json", "segments.log", "segments.txt",
                                                           "summary.txt"]
    assert "skipped" in (tmp_path / "pytest_cuda.log").read_text()  # collected, and skipped without a GPU
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert {(row["method"], row["prompt_tokens"]) for row in rows} == {
        (method, length) for method in ("fullkv", "snapkv", "restkv") for length in (160, 288)}
    segments = {row["method"] for row in json.loads((tmp_path / "segments.json").read_text())}
    assert segments == {"snapkv", "snapkv+quant_method=kivi+nbits=4", "snapkv+think", "snapkv+residual", "momentkv",
                        "adakv"}
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("tiny, float32, sdpa, cpu") and summary.count("(ratios vs fullkv)") == 2
    assert summary.count("snapkv+quant_method=kivi+nbits=4") == 1  # the segments' table
    assert summary.rstrip().endswith("vllm: skipped (no CUDA vLLM environment at .venv-vllm/bin/python)")


def test_peak_memory_runs_each_method_in_a_fresh_process_and_reports_its_high_water_mark(tmp_path):
    """scripts/efficiency.py --peak_memory on the tiny shape: one row per method with the
    process's peak and what it held above the loaded model; chunking keeps snapkv's cache."""
    out = tmp_path / "peak.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "efficiency.py"), "--peak_memory", "--config", "tiny", "--lengths",
         "192", "--budget", "48", "--decode_steps", "2", "--methods", "fullkv", "snapkv",
         "snapkv+prefill_chunk_size=64", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    rows = {row["method"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["fullkv", "snapkv", "snapkv+prefill_chunk_size=64"]
    for row in rows.values():
        assert row["peak_memory_bytes"] >= row["peak_above_ready_bytes"] > 0 and row["prompt_tokens"] == 192
    assert rows["snapkv+prefill_chunk_size=64"]["cache_bytes"] == rows["snapkv"]["cache_bytes"] < rows["fullkv"]["cache_bytes"]
    assert "above model" in done.stdout
