"""The runners' shared command line: compression flags, checks, datasets, shards, prompt limits."""

from __future__ import annotations

import argparse
import os

import pytest
from top_level import script_help
from toy_benchmark import TOY

from restkv.benchmarks import flags
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.flags import (build_parser, compression_config_from_args, default_model_max_len,
                                     selected_datasets, shard_of)
from restkv.config import CompressionConfig, flat_option_specs


def test_every_config_field_is_a_flag_with_its_help_and_choices():
    parser = build_parser(TOY)
    actions = {action.dest: action for action in parser._actions}
    for name, declarations in flat_option_specs().items():
        _, field = declarations[0]
        action = actions[name]
        assert f"--{field.name}" in action.option_strings
        assert field.help in action.help
        if field.choices is not None:
            assert tuple(action.choices) == tuple(field.choices)
        if field.kind is bool:
            assert f"--no-{field.name}" in action.option_strings
        assert action.default is None, "unset flags must leave the config's own default"


def test_flags_build_the_config_and_unset_flags_keep_the_defaults():
    args = build_parser(TOY).parse_args(
        "--method SnapKV --max_capacity_prompts 128 --window_size 16 --l2norm_skip_layers 0 3 --h2o_normalize".split()
    )
    assert compression_config_from_args(args) == CompressionConfig(
        method="snapkv", max_capacity_prompts=128, window_size=16, l2norm_skip_layers=(0, 3), h2o_normalize=True
    )


def test_the_original_release_command_line_parses():
    """scripts/longbench/run.sh of the release: --use_cache True, FullKV with a budget."""
    args = build_parser(TOY).parse_args(
        "--method FullKV --model_path meta-llama/Llama-3.1-8B-Instruct --max_capacity_prompts 128 "
        "--attn_implementation sdpa --save_dir out --use_cache True --window_size 32".split()
    )
    assert args.use_cache is True
    config = compression_config_from_args(args)
    assert config.method == "fullkv" and config.max_capacity_prompts is None  # fullkv keeps everything
    assert build_parser(TOY).parse_args(["--use_cache"]).use_cache is True
    with pytest.raises(SystemExit):
        build_parser(TOY).parse_args(["--use_cache", "maybe"])


@pytest.mark.parametrize(
    "command_line, message",
    [
        ("--method nosuch --max_capacity_prompts 8", "--method 'nosuch' is not a known method"),
        ("--method snapkv --max_capacity_prompts 64 --kernel_size 4", "--kernel_size must be odd"),
        ("--method snapkv", "needs a budget"),
        ("--method snapkv --max_capacity_prompts 64 --dataset nosuch", "unknown toy dataset(s) nosuch"),
        ("--method snapkv --max_capacity_prompts 64 --num_shards 2 --shard_id 2", "--shard_id must lie in 0..1"),
        ("--method fullkv --num_shards 0", "--num_shards must be >= 1; got 0"),
        ("--method fullkv --model_max_len 1", "--model_max_len must be >= 2; got 1"),
        ("--method fullkv --model_max_len -3", "--model_max_len must be >= 2; got -3"),
        ("--method fullkv --max_new_tokens 0", "--max_new_tokens must be >= 1; got 0"),
        ("--method fullkv --max_num_examples 0", "--num_samples must be >= 1; got 0"),  # the release's name
        ("--method fullkv --num_samples 0", "--num_samples must be >= 1; got 0"),
        ("--method fullkv --use_cache False", "--use_cache False"),
        ("--method fullkv --model_path /no/such/model", "--model_path /no/such/model: no such folder"),
        ("--method fullkv --model_path ./models/typo", "embedded model (smollm2-135m, gemma3-270m)"),
    ],
)
def test_bad_flags_stop_with_a_message_naming_the_flag(command_line, message, capsys):
    with pytest.raises(SystemExit):
        flags.parse_args(TOY, command_line.split())
    assert message in capsys.readouterr().err


def test_model_paths_that_may_be_hub_ids_or_exist_are_accepted(tmp_path):
    for path in ("smollm2-135m", "org/new-model", str(tmp_path)):
        assert flags.parse_args(TOY, ["--method", "fullkv", "--model_path", path]).model_path == path


def test_dataset_selection():
    parse = build_parser(TOY).parse_args
    assert selected_datasets(parse([]), TOY) == ["logs"]
    assert selected_datasets(parse(["--dataset", "other"]), TOY) == ["other"]
    assert selected_datasets(parse(["--datasets", "other", "logs", "other"]), TOY) == ["other", "logs"]
    assert selected_datasets(parse(["--datasets", "other,logs"]), TOY) == ["other", "logs"]
    with pytest.raises(DataError, match="known: logs, other"):
        selected_datasets(parse(["--datasets", "logs", "nope"]), TOY)
    with pytest.raises(DataError, match="either --dataset or --datasets"):
        selected_datasets(parse(["--dataset", "logs", "--datasets", "other"]), TOY)


def test_shards_come_from_the_flags_or_torchrun():
    parse = build_parser(TOY).parse_args
    assert shard_of(parse([]), environ={}) == (0, 1)
    assert shard_of(parse(["--num_shards", "4", "--shard_id", "3"]), environ={}) == (3, 4)
    assert shard_of(parse([]), environ={"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)
    assert shard_of(parse(["--num_shards", "1"]), environ={"RANK": "1", "WORLD_SIZE": "2"}) == (0, 1)
    with pytest.raises(ValueError, match="--shard_id needs --num_shards"):
        shard_of(parse(["--shard_id", "1"]), environ={})


@pytest.mark.parametrize(
    "path, expected",
    [
        ("smollm2-135m", 7950),
        ("gemma3-270m", 7950),
        ("meta-llama/Llama-3.1-8B-Instruct", 127000),
        ("meta-llama/Meta-Llama-3-70B-Instruct", 7950),
        ("meta-llama/Meta-Llama-3-8B-Instruct", 7950),
        ("/models/Llama-2-7b-chat-hf", 3950),
        ("mistralai/Mistral-7B-Instruct-v0.3", 31500),
        ("Qwen/Qwen2.5-7B-Instruct", 127000),
    ],
)
def test_default_prompt_length_per_model(path, expected):
    assert default_model_max_len(path, argparse.Namespace(max_position_embeddings=8192)) == expected


def test_default_prompt_length_of_an_unknown_model_leaves_room_for_the_answer():
    assert default_model_max_len("org/new-model", argparse.Namespace(max_position_embeddings=4096)) == 4096 - 512
    with pytest.raises(ValueError, match="give --model_max_len"):
        default_model_max_len("org/new-model", None)
    with pytest.raises(ValueError, match="give --model_max_len"):  # no room for a prompt
        default_model_max_len("org/new-model", argparse.Namespace(max_position_embeddings=512))


@pytest.mark.parametrize(
    "script, own_flag",
    [
        ("run_longbench.py", "--query_agnostic"),
        ("run_ruler.py", "--context_lengths"),
        ("run_needle_in_haystack.py", "--depth_intervals"),
        ("run_infinite_bench.py", "--generation_lengths"),
        ("eval.py", "--buckets"),
        ("eval_ruler.py", "--results_dir"),
        ("eval_infinite.py", "--results_dir"),
    ],
)
def test_top_level_scripts_are_command_lines_over_the_library(script, own_flag):
    code, text = script_help(script)
    assert code == 0 and text.startswith(f"usage: {script}") and own_flag in text


def test_an_output_path_is_checked_without_writing_anything(tmp_path):
    """Every command's output flag goes through this check while its flags are parsed: a path
    found unwritable only when the results are saved loses the work (a traceback after it)."""
    from restkv.benchmarks.flags import check_output_path

    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_folder").mkdir()
    deeper = tmp_path / "new" / "deeper" / "out.json"
    assert check_output_path(str(deeper), "--out") == deeper  # its folders are made when it is written
    assert check_output_path(str(tmp_path / "a_file"), "--out") == tmp_path / "a_file"  # overwritten when done
    assert check_output_path(str(tmp_path / "a_folder"), "--save_dir", folder=True) == tmp_path / "a_folder"
    assert check_output_path(str(tmp_path / "new_folder"), "--save_dir", folder=True) == tmp_path / "new_folder"
    refusals = [
        ((str(tmp_path / "a_folder"), "--out"), f"--out {tmp_path / 'a_folder'}: a folder; give a file path"),
        ((str(tmp_path / "a_file"), "--save_dir", True), f"--save_dir {tmp_path / 'a_file'}: a file; give a folder"),
        ((str(tmp_path / "a_file" / "x" / "out.json"), "--out"),
         f"--out {tmp_path / 'a_file' / 'x' / 'out.json'}: cannot make its folder: {tmp_path / 'a_file'} is a file"),
    ]
    for args, message in refusals:
        with pytest.raises(flags.FlagError) as refused:
            check_output_path(*args)
        assert str(refused.value).startswith(message)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a_file", "a_folder"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_folder_without_write_permission_is_refused(tmp_path):
    from restkv.benchmarks.flags import check_output_path

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(flags.FlagError, match="--out .*: cannot write in .*locked"):
        check_output_path(str(locked / "out.json"), "--out")


def test_a_save_dir_that_is_a_file_stops_the_runner_while_its_flags_are_parsed(tmp_path, capsys):
    """It was a NotADirectoryError traceback after the model had loaded."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit):
        flags.parse_args(TOY, ["--method", "fullkv", "--save_dir", str(tmp_path / "a_file")])
    assert f"--save_dir {tmp_path / 'a_file'}: a file; give a folder" in capsys.readouterr().err


def test_flash_attention_without_flash_attn_or_cuda_is_refused_before_loading(monkeypatch, capsys):
    """transformers' ImportError (or a CUDA error) came after the data were read and the folder claimed."""
    import importlib.util

    import torch

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "flash_attn" else real_find_spec(name, *args))
    with pytest.raises(SystemExit):
        flags.parse_args(TOY, ["--method", "fullkv", "--attn_implementation", "flash_attention_2"])
    assert "--attn_implementation flash_attention_2 needs flash-attn: pip install 'restkv[flash]'" in \
        capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())  # installed, but no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        flags.parse_args(TOY, ["--method", "fullkv", "--attn_implementation", "flash_attention_2"])
    assert "--attn_implementation flash_attention_2 needs a CUDA GPU" in capsys.readouterr().err
