"""Every runner and evaluator reports bad input the same way: one line ``error: ...`` on stderr
and a non-zero exit, never a traceback; and runners find it before they load the model."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from toy_benchmark import TOY, toy_run

from restkv.benchmarks import infinitebench, longbench, needle, ruler, runner
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.results import ResultWriter, shard_path

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "fixtures"


def one_line_error(call) -> str:
    """The message ``call`` exits with; it must be a single ``error: ...`` line."""
    with pytest.raises(SystemExit) as stop:
        call()
    message = stop.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def ruler_run(tiny, tokenizer, ruler_dir, save_dir, *flags):
    argv = ["--data_dir", str(ruler_dir), "--context_lengths", "600", "--datasets", "niah_single_1",
            "--method", "snapkv", "--max_capacity_prompts", "64", "--window_size", "8", "--max_new_tokens", "2",
            "--save_dir", str(save_dir), *flags]
    return ruler.run(argv, model=tiny, tokenizer=tokenizer)


def test_run_ruler_reports_missing_data_and_a_folder_of_other_settings(tiny, tokenizer, ruler_dir, tmp_path):
    missing = one_line_error(lambda: ruler_run(tiny, tokenizer, tmp_path / "nothing", tmp_path))
    assert "no RULER data for task 'niah_single_1' at length 600" in missing
    ruler_run(tiny, tokenizer, ruler_dir, tmp_path)
    other = one_line_error(lambda: ruler_run(tiny, tokenizer, ruler_dir, tmp_path, "--kernel_size", "7"))
    assert "holds a run with other settings (config.kernel_size: 5 -> 7)" in other


def test_run_needle_reports_a_folder_of_other_settings(tiny, tokenizer, tmp_path):
    argv = ["--method", "fullkv", "--context_lengths", "300", "--depth_intervals", "1",
            "--final_context_length_buffer", "100", "--max_new_tokens", "2", "--save_dir", str(tmp_path)]
    needle.run(argv, model=tiny, tokenizer=tokenizer)
    message = one_line_error(lambda: needle.run([*argv, "--no-chat_template"], model=tiny, tokenizer=tokenizer))
    assert "benchmark_flags.chat_template: True -> False" in message


def test_a_second_process_on_the_same_dataset_and_shard_is_one_line(tiny, tokenizer, tmp_path):
    folder = toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1")
    with ResultWriter(shard_path(folder, "logs", 0, 1)):
        message = one_line_error(lambda: toy_run(tmp_path, tiny, tokenizer))
    assert "logs.jsonl is being written by another process" in message


@pytest.mark.parametrize("evaluate", [ruler.evaluate, infinitebench.evaluate])
def test_evaluators_report_a_missing_results_folder(evaluate, tmp_path):
    message = one_line_error(lambda: evaluate(["--results_dir", str(tmp_path / "typo")]))
    assert str(tmp_path / "typo") in message


def test_the_toy_runner_reports_bad_data(tiny, tokenizer, tmp_path):
    def broken(args, dataset, tokenizer):
        raise DataError("toy.jsonl:3: missing field 'answers'")

    toy = dataclasses.replace(TOY, load_samples=broken)
    argv = ["--save_dir", str(tmp_path), "--method", "fullkv"]
    message = one_line_error(lambda: runner.main(toy, argv, model=tiny, tokenizer=tokenizer))
    assert message == "error: toy.jsonl:3: missing field 'answers'"


# ----------------------------------------------------------------------------- before the model


def test_every_longbench_data_file_is_checked_before_the_model(no_model_loading, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(FIXTURES / "LongBench" / "samsum.jsonl", data)
    argv = ["--data_dir", str(data), "--save_dir", str(tmp_path / "out"), "--method", "fullkv"]
    message = one_line_error(lambda: longbench.run([*argv, "--datasets", "samsum", "hotpotqa"]))
    assert "hotpotqa.jsonl: no such data file" in message
    assert f"THUDM/LongBench (https://huggingface.co/datasets/THUDM/LongBench): python -m restkv.data longbench " \
        f"--datasets hotpotqa --data_dir {data} fetches it" in message
    (data / "hotpotqa.jsonl").write_text('{"input": "q"}\n', encoding="utf-8")
    message = one_line_error(lambda: longbench.run([*argv, "--datasets", "samsum", "hotpotqa"]))
    assert "hotpotqa.jsonl:1: missing field 'context'" in message
    assert not list((tmp_path / "out").rglob("*.jsonl"))  # samsum was not run either


def test_a_malformed_ruler_file_is_found_before_the_model(no_model_loading, ruler_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(ruler_dir, data)
    broken = data / "600" / "vt" / "validation.jsonl"
    broken.parent.mkdir()
    broken.write_text(json.dumps({"input": "no outputs"}) + "\n", encoding="utf-8")
    argv = ["--data_dir", str(data), "--context_lengths", "600", "--datasets", "niah_single_1,vt",
            "--method", "fullkv", "--save_dir", str(tmp_path / "out")]
    message = one_line_error(lambda: ruler.run(argv))
    assert "vt/validation.jsonl:1: a RULER sample needs 'input' and 'outputs'" in message


def test_a_missing_infinitebench_file_is_found_before_the_model(no_model_loading, tmp_path):
    argv = ["--data_dir", str(FIXTURES / "infinitebench"), "--datasets", "passkey,nosuch_task", "--method", "fullkv",
            "--save_dir", str(tmp_path)]
    with pytest.raises(SystemExit):  # an unknown task is a flag error
        infinitebench.run(argv)
    empty = tmp_path / "empty"
    argv = ["--data_dir", str(empty), "--datasets", "passkey", "--method", "fullkv", "--save_dir", str(tmp_path)]
    message = one_line_error(lambda: infinitebench.run(argv))
    assert "passkey.jsonl: no such data file; the infinitebench files <data_dir>/<name>.jsonl come from the root of " \
        "the Hugging Face dataset xinrongzhang2022/InfiniteBench" in message
    assert f"python -m restkv.data infinitebench --datasets passkey --data_dir {empty} fetches it" in message


def test_a_busy_folder_is_found_before_the_model(no_model_loading, tokenizer, tmp_path):
    folder = tmp_path / "smollm2-135m" / "fullkv"
    with ResultWriter(shard_path(folder, "logs", 0, 1)):
        message = one_line_error(lambda: runner.main(TOY, ["--save_dir", str(tmp_path), "--method", "fullkv"],
                                                     tokenizer=tokenizer))
    assert "is being written by another process" in message
