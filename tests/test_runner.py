"""The shared benchmark runner: flags, prompts, output files, resume, shards, compression check."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from restkv.benchmarks import runner
from restkv.benchmarks.runner import (
    Benchmark,
    CompressionNotApplied,
    DataError,
    ResultWriter,
    Sample,
    build_parser,
    compression_config_from_args,
    default_model_max_len,
    encode_prompt,
    read_predictions,
    results_dir,
    selected_datasets,
    shard_of,
)
from restkv.config import CompressionConfig, flat_option_specs
from restkv.models import load_tokenizer
from tiny_models import tiny_model
from top_level import script_help

STORY = " ".join(f"On day {i} the keeper of the lighthouse wrote that the sea was calm." for i in range(12))


def toy_samples(args, dataset):
    """Five prompts of ~170 tokens whose answer is a number in the context."""
    return [
        Sample(
            id=f"q{i}",
            context=f"Read the log.\n\n{STORY} The door code is {4000 + 17 * i}.\n\n",
            question="Question: what is the door code?\nAnswer:",
            max_new_tokens=3,
            fields={"answers": [str(4000 + 17 * i)]},
        )
        for i in range(5)
    ]


TOY = Benchmark("toy", datasets=("logs", "other"), default_datasets=("logs",), load_samples=toy_samples,
                default_data_dir="data/toy")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary: real prompts, fast deterministic answers."""
    return tiny_model("llama", vocab_size=len(tokenizer))


def toy_run(tmp_path, tiny, tokenizer, *flags):
    base = ["--save_dir", str(tmp_path), "--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8"]
    return runner.main(TOY, [*base, *flags], model=tiny, tokenizer=tokenizer)


def lines_of(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------- flags


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
    "flags, message",
    [
        ("--method nosuch --max_capacity_prompts 8", "--method 'nosuch' is not a known method"),
        ("--method snapkv --max_capacity_prompts 64 --kernel_size 4", "--kernel_size must be odd"),
        ("--method snapkv", "needs a budget"),
        ("--method snapkv --max_capacity_prompts 64 --dataset nosuch", "unknown toy dataset(s) nosuch"),
        ("--method snapkv --max_capacity_prompts 64 --num_shards 2 --shard_id 2", "--shard_id must lie in 0..1"),
    ],
)
def test_bad_flags_stop_with_a_message_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(TOY, flags.split())
    assert message in capsys.readouterr().err


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


def test_results_folder_names():
    snap = CompressionConfig(method="snapkv", max_capacity_prompts=128)
    assert results_dir("out", "smollm2-135m", snap) == Path("out/smollm2-135m/snapkv_128")
    agnostic = results_dir("out", "/models/Llama-3.1-8B/", snap, query_agnostic=True, tag="k7")
    assert agnostic == Path("out/Llama-3.1-8B/snapkv_128_agnostic_k7")
    ratio = CompressionConfig(method="snapkv", compression_ratio=0.75)
    assert results_dir("out", "smollm2-135m", ratio).name == "snapkv_ratio0.75"
    assert results_dir("out", "smollm2-135m", CompressionConfig(method="fullkv")).name == "fullkv"


# ------------------------------------------------------------------------------- output files


def test_writer_redoes_a_half_written_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    with ResultWriter(path) as writer:
        writer.write({"id": "a", "pred": "x"})
        writer.write({"id": "b", "pred": "é"})
    complete = path.read_bytes()
    path.write_bytes(complete + '{"id": "c", "pred": "é'.encode("utf-8")[:-1])  # cut inside a character
    with ResultWriter(path) as writer:
        assert writer.ids == {"a", "b"}
        assert path.read_bytes() == complete
        writer.write({"id": "c", "pred": "z"})
    assert [record["id"] for record in lines_of(path)] == ["a", "b", "c"]


def test_writer_refuses_a_corrupt_line_and_a_second_writer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        ResultWriter(path)
    path.write_text('{"id": "a"}\n{"pred": "no id"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"d.jsonl:2: missing field 'id'"):
        ResultWriter(path)
    other = tmp_path / "e.jsonl"
    with ResultWriter(other):
        with pytest.raises(RuntimeError, match="being written by another process"):
            ResultWriter(other)


def test_reading_merges_shards_in_data_order(tmp_path, capsys):
    (tmp_path / "d.shard-1-of-2.jsonl").write_text(
        '{"id": "b", "index": 1, "pred": "B"}\n{"id": "d", "index": 3, "pred": "D"}\n{"id": "x", "ind', encoding="utf-8"
    )
    (tmp_path / "d.shard-0-of-2.jsonl").write_text(
        '{"id": "c", "index": 2, "pred": "C"}\n{"id": "a", "index": 0, "pred": "A"}\n', encoding="utf-8"
    )
    (tmp_path / "d.jsonl").write_text('{"id": "a", "index": 0, "pred": "A"}\n', encoding="utf-8")
    (tmp_path / "dd.jsonl").write_text('{"id": "z", "index": 0, "pred": "Z"}\n', encoding="utf-8")
    assert [r["pred"] for r in read_predictions(tmp_path, "d")] == ["A", "B", "C", "D"]
    assert "skipped a half-written last line" in capsys.readouterr().err
    assert runner.datasets_in(tmp_path) == ["d", "dd"]


def test_official_prediction_files_are_read_as_they_are(tmp_path):
    """LongBench's pred.py lines: no id, no index; order and every line kept."""
    (tmp_path / "trec.jsonl").write_text('{"pred": "b"}\n{"pred": "a"}\n{"pred": "a"}', encoding="utf-8")
    assert [r["pred"] for r in read_predictions(tmp_path, "trec")] == ["b", "a", "a"]


# ------------------------------------------------------------------------------- prompts


def test_query_aware_prompt_is_the_chat_wrapped_text(tokenizer):
    sample = toy_samples(None, "logs")[0]
    encoded = encode_prompt(tokenizer, sample, max_tokens=4000)
    wrapped = tokenizer.apply_chat_template(
        [{"role": "user", "content": sample.context + sample.question}], add_generation_prompt=True, tokenize=False
    )
    assert encoded.context_ids == tokenizer(wrapped, add_special_tokens=False).input_ids
    assert encoded.question_ids == [] and not encoded.truncated


def test_query_agnostic_prompt_splits_before_the_question(tokenizer):
    sample = toy_samples(None, "logs")[0]
    aware = encode_prompt(tokenizer, sample, max_tokens=4000)
    agnostic = encode_prompt(tokenizer, sample, max_tokens=4000, split=True)
    context_text = tokenizer.decode(agnostic.context_ids)
    question_text = tokenizer.decode(agnostic.question_ids)
    assert "door code is 4000" in context_text and "Question" not in context_text
    assert question_text.startswith("Question: what is the door code?")
    assert question_text.endswith("<|im_start|>assistant\n")
    assert context_text + question_text == tokenizer.decode(aware.context_ids)


def test_raw_prompts_and_answer_prefix(tokenizer):
    sample = dataclasses.replace(toy_samples(None, "logs")[0], chat=False, answer_prefix=" The code is")
    text = sample.context + sample.question + sample.answer_prefix
    assert encode_prompt(tokenizer, sample, 4000).context_ids == tokenizer(text).input_ids
    chat = dataclasses.replace(sample, chat=True)
    assert tokenizer.decode(encode_prompt(tokenizer, chat, 4000).context_ids).endswith("assistant\n The code is")
    split = encode_prompt(tokenizer, chat, 4000, split=True)
    assert tokenizer.decode(split.question_ids).endswith("assistant\n The code is")


def test_long_prompts_are_cut_in_the_middle(tokenizer):
    sample = toy_samples(None, "logs")[0]
    encoded = encode_prompt(tokenizer, dataclasses.replace(sample, chat=False), max_tokens=64)
    text = tokenizer.decode(encoded.context_ids)
    assert encoded.truncated and abs(encoded.num_tokens - 64) <= 2  # re-tokenising may merge at the cut
    assert text.startswith("Read the log.") and text.endswith(sample.question)
    assert "day 5 " not in text
    split = encode_prompt(tokenizer, sample, max_tokens=64, split=True)
    assert tokenizer.decode(split.question_ids).startswith(sample.question)


def test_a_question_longer_than_the_kept_half_is_cut_with_the_context(tokenizer):
    long_question = "Question: " + STORY
    sample = Sample(id="x", context="Intro. " + STORY, question=long_question, max_new_tokens=1, chat=False)
    encoded = encode_prompt(tokenizer, sample, max_tokens=40, split=True)
    assert encoded.truncated and 0 < len(encoded.question_ids) <= 21


def test_stop_tokens_include_every_eos_and_extra_texts(tokenizer, tiny):
    tiny.generation_config.eos_token_id = [2, 7]
    try:
        assert runner.stop_token_ids(tiny, tokenizer, ["\n"]) == [2, 7, 198]
    finally:
        tiny.generation_config.eos_token_id = 2


# ------------------------------------------------------------------------------- the run


def test_a_run_writes_one_line_per_sample_with_its_cache_record(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer)
    assert folder == tmp_path / "smollm2-135m" / "snapkv_48"
    records = lines_of(folder / "logs.jsonl")
    assert [r["id"] for r in records] == [f"q{i}" for i in range(5)] and [r["index"] for r in records] == list(range(5))
    first = records[0]
    assert first["answers"] == ["4000"] and isinstance(first["pred"], str)
    assert first["question_tokens"] == 0 and first["prompt_tokens"] > 48
    # The cache has seen every token but the last generated one (never fed back).
    assert first["kv_tokens_seen"] == first["prompt_tokens"] + first["new_tokens"] - 1
    assert first["kv_layers_compressed"] == tiny.config.num_hidden_layers
    assert first["kv_tokens_stored"] == 48 + first["new_tokens"] - 1
    meta = json.loads((folder / "run_meta.json").read_text())
    expected = CompressionConfig(method="snapkv", max_capacity_prompts=48, window_size=8)
    assert CompressionConfig.from_any(meta["settings"]["config"]) == expected  # the run can be rebuilt
    assert meta["settings"]["model_max_len"] == 7950 and meta["settings"]["query_agnostic"] is False
    assert meta["versions"]["torch"] == torch.__version__ and "sha" in meta["git"]


def test_query_agnostic_run_compresses_the_context_alone(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer, "--query_agnostic", "--max_num_examples", "2")
    assert folder.name == "snapkv_48_agnostic"
    records = lines_of(folder / "logs.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["question_tokens"] > 0
        # The question and answer were appended after compressing the context to 48 tokens.
        assert record["kv_tokens_stored"] == 48 + record["question_tokens"] + record["new_tokens"] - 1


def test_resume_after_a_kill_loses_nothing_and_duplicates_nothing(tmp_path, tiny, tokenizer, monkeypatch):
    reference = lines_of(toy_run(tmp_path / "reference", tiny, tokenizer) / "logs.jsonl")
    real_generate, calls = runner.generate, []

    def killed_on_third_sample(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(runner, "generate", killed_on_third_sample)
    with pytest.raises(KeyboardInterrupt):
        toy_run(tmp_path / "resumed", tiny, tokenizer)
    path = tmp_path / "resumed" / "smollm2-135m" / "snapkv_48" / "logs.jsonl"
    assert len(lines_of(path)) == 2
    with open(path, "a", encoding="utf-8") as handle:  # the kill also tore the line in flight
        handle.write('{"id": "q2", "index": 2, "pred": "half')
    monkeypatch.setattr(runner, "generate", real_generate)
    toy_run(tmp_path / "resumed", tiny, tokenizer)
    resumed = lines_of(path)
    assert [r["id"] for r in resumed] == [r["id"] for r in reference]
    assert [r["pred"] for r in resumed] == [r["pred"] for r in reference]


def test_sharded_runs_merge_to_the_unsharded_result(tmp_path, tiny, tokenizer):
    whole = toy_run(tmp_path / "whole", tiny, tokenizer)
    for shard in ("0", "1"):
        sharded = toy_run(tmp_path / "sharded", tiny, tokenizer, "--num_shards", "2", "--shard_id", shard)
    assert sorted(p.name for p in sharded.glob("*.jsonl")) == ["logs.shard-0-of-2.jsonl", "logs.shard-1-of-2.jsonl"]
    assert [r["index"] for r in lines_of(sharded / "logs.shard-1-of-2.jsonl")] == [1, 3]

    def essentials(records):
        return [(r["id"], r["index"], r["pred"], r["prompt_tokens"]) for r in records]

    assert essentials(read_predictions(sharded, "logs")) == essentials(read_predictions(whole, "logs"))


def test_a_folder_refuses_a_run_with_other_settings(tmp_path, tiny, tokenizer):
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1")
    message = r"holds a run with other settings \(config.kernel_size: 5 -> 7; config.window_size: 8 -> 4\)"
    with pytest.raises(SystemExit, match=message):
        toy_run(tmp_path, tiny, tokenizer, "--kernel_size", "7", "--window_size", "4")
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2")  # more samples, same settings: fine
    assert len(lines_of(tmp_path / "smollm2-135m" / "snapkv_48" / "logs.jsonl")) == 2


def test_a_benchmark_flag_that_changes_predictions_is_part_of_the_run_settings(tmp_path, tiny, tokenizer):
    toy = dataclasses.replace(TOY, prediction_flags=("answer_style",))

    def add_flags(parser):
        parser.add_argument("--answer_style", default="short")

    base = ["--save_dir", str(tmp_path), "--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8",
            "--max_num_examples", "1"]
    runner.main(toy, base, add_flags, model=tiny, tokenizer=tokenizer)
    with pytest.raises(SystemExit, match=r"benchmark_flags.answer_style: 'short' -> 'long'"):
        runner.main(toy, [*base, "--answer_style", "long"], add_flags, model=tiny, tokenizer=tokenizer)


def test_an_unpatched_model_stops_the_run(tiny, tokenizer):
    """Silent no-compression (the patch not active) must not produce plausible numbers."""
    config = CompressionConfig(method="snapkv", max_capacity_prompts=48, window_size=8)
    sample = toy_samples(None, "logs")[0]
    encoded = encode_prompt(tokenizer, sample, 4000)
    result = runner.generate(tiny, tokenizer, encoded, 2, [2])  # conftest leaves attention unpatched
    with pytest.raises(CompressionNotApplied, match="kept every token"):
        runner.compression_record(tiny, config, result.cache, len(encoded.context_ids))
    # A prompt within the budget, or the full cache, needs no compression.
    assert runner.compression_record(tiny, config, result.cache, 40)["kv_layers_compressed"] == 0
    assert runner.compression_record(tiny, CompressionConfig(method="fullkv"), result.cache, 500)


def test_format_table():
    table = runner.format_table([{"run": "a", "x": 1.234, "y": None}, {"run": "bb", "x": float("nan"), "y": 2.0}],
                                ["x", "y"])
    assert table.splitlines() == ["run     x     y", "a    1.23     -", "bb      -  2.00"]


def test_read_jsonl_numbers_lines_and_names_bad_ones(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n', encoding="utf-8")
    assert list(runner.read_jsonl(path)) == [(1, {"a": 1}), (3, {"a": 2})]
    path.write_text('{"a": 1}\n[1]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"data.jsonl:2: expected a JSON object"):
        list(runner.read_jsonl(path))


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
