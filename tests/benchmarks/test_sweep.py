"""The README's budget sweep: flags, labels, and one small end-to-end run on the embedded model."""

import json

import pytest

from restkv.benchmarks import sweep
from restkv.benchmarks.results import read_predictions
from restkv.config import ConfigError


def test_method_specs_become_runner_flags():
    assert sweep.method_flags("snapkv") == ["--method", "snapkv"]
    assert sweep.method_flags("adakv+residual+residual_no_gate") == [  # the folder names --residual itself
        "--method", "adakv", "--residual", "--residual_no_gate", "--tag", "residual_no_gate"]
    with pytest.raises(ConfigError, match="'bogus' is not a boolean option"):
        sweep.method_flags("snapkv+bogus")


def test_budget_labels():
    args = sweep.build_parser().parse_args(["--compression_ratios", "0.9", "0.8"])
    assert [sweep.budget_label(flags) for flags in sweep.budget_flags(args)] == ["10%", "20%"]
    args = sweep.build_parser().parse_args([])
    assert [sweep.budget_label(flags) for flags in sweep.budget_flags(args)] == ["256", "512"]
    assert sweep.budget_label([]) == "full"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--methods", "snapkv", "nosuch"], "--method 'nosuch' is not a known method"),
        (["--methods", "snapkv+bogus"], "'bogus' is not a boolean option"),
        (["--budgets", "256", "0"], "--max_capacity_prompts must be >= 1; got 0"),
        (["--budgets", "16"], "--max_capacity_prompts"),  # no more than snapkv's 32-token window
        (["--compression_ratios", "0.9", "1.5"], "--compression_ratio must lie in the open interval (0, 1)"),
        (["--num_shards", "0"], "--num_shards must be >= 1; got 0"),
        (["--num_samples", "0"], "--num_samples must be >= 1; got 0"),
        (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1; got 0"),
        (["--multi_question", "--tasks", "niah_single_1,vt"], "--multi_question asks about each inserted needle"),
        (["--tasks", "nosuch"], "unknown RULER task 'nosuch'"),
        (["--length", "100"], "--length 100 leaves no room for niah_single_1's 128 generated tokens"),
        (["--attn_implementation", "fast"], "invalid choice: 'fast'"),
        (["--methods", "snapkv", "laprox+observation=reconstruction"],
         "--method laprox scores with each window query's own attention row"),  # issue 20: once after 138 s of runs
    ],
)
def test_every_configuration_is_checked_before_the_first_runs(flags, message, tmp_path, capsys, no_model_loading):
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--save_dir", str(tmp_path), *flags])
    error = capsys.readouterr().err
    assert stop.value.code == 2 and message in error
    assert error.startswith("usage: python -m restkv.benchmarks.sweep")
    assert not any(tmp_path.iterdir())  # no data generated, nothing run


@pytest.mark.embedded
def test_a_small_sweep_runs_every_configuration_and_reports_what_the_cache_kept(smollm2, tmp_path, capsys):
    model, tokenizer = smollm2
    argv = ["--length", "512", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "streamingllm",
            "snapkv", "snapkv+residual", "--budgets", "64", "--save_dir", str(tmp_path)]
    rows = sweep.run_sweep(sweep.build_parser().parse_args(argv), model=model, tokenizer=tokenizer)
    assert [(row["method"], row["budget"]) for row in rows] == [
        ("fullkv", "full"), ("streamingllm", "64"), ("snapkv", "64"), ("snapkv+residual", "64")]
    assert rows[0]["kv kept"] == "1.00"
    for row in rows[1:]:
        assert float(row["kv kept"]) < 0.25  # 64 of ~500 tokens per layer, tail included
        assert 0 <= row["niah_single_1"] <= 100
    # A rerun finds every sample written and recomputes nothing (each line records its own timing).
    written = {path: path.read_text() for path in tmp_path.rglob("*.jsonl") if "data" not in path.parts}
    assert len(written) == 4  # the residual run has its own folder
    again = sweep.run_sweep(sweep.build_parser().parse_args(argv), model=model, tokenizer=tokenizer)
    assert again == rows
    assert {path: path.read_text() for path in written} == written


def test_a_sharded_sweep_marks_every_score_that_stands_on_part_of_the_samples(tmp_path, tiny, tokenizer):
    """Shard 0 of 2 holds 1 of each task's 2 samples: its table must not read as a full one."""
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "2", "--methods", "snapkv",
            "--budgets", "64", "--save_dir", str(tmp_path), "--num_shards", "2", "--shard_id", "0"]
    args = sweep.build_parser().parse_args(argv)
    rows = sweep.run_sweep(args, model=tiny, tokenizer=tokenizer)
    assert [row["samples"] for row in rows] == ["1/2", "1/2"]
    table = sweep.report(args, rows).splitlines()
    assert table[0] == "RULER 400 tokens, 2 samples per task (shard 0 of 2), smollm2-135m, query-aware"
    assert table[1].split() == ["method", "budget", "niah_single_1", "avg", "kv", "kept", "samples"]
    assert table[2].split()[2:4] == [f"{rows[0]['niah_single_1']:.2f}*"] * 2 and table[2].split()[-1] == "1/2"
    assert "* fullkv full / niah_single_1: 1/2 samples" in table



def test_a_method_spec_can_set_an_option_to_a_value():
    assert sweep.method_flags("snapkv+residual+observation=reconstruction") == [
        "--method", "snapkv", "--residual", "--observation", "reconstruction"]  # the folder names both
    assert sweep.method_flags("snapkv+kernel_size=7") == ["--method", "snapkv", "--kernel_size", "7",
                                                          "--tag", "kernel_size=7"]


def test_a_multi_question_sweep_runs_reconstruction_and_kvzip_and_records_them(tmp_path, tiny, tokenizer):
    """Every needle of a context compressed once is a question of its own; the run folders record
    the observation, the method and the mode."""
    argv = ["--length", "400", "--tasks", "niah_single_1,niah_multikey_1", "--num_samples", "1", "--methods",
            "snapkv", "snapkv+observation=reconstruction", "kvzip", "--budgets", "64",
            "--multi_question", "--max_new_tokens", "3", "--save_dir", str(tmp_path)]
    args = sweep.parse_args(argv)
    rows = sweep.run_sweep(args, model=tiny, tokenizer=tokenizer)
    assert [(row["method"], row["budget"], row["samples"]) for row in rows] == [
        ("fullkv", "full", "5/5"), ("snapkv", "64", "5/5"), ("snapkv+observation=reconstruction", "64", "5/5"),
        ("kvzip", "64", "5/5")]
    folders = sorted(path.parent for path in (tmp_path / "smollm2-135m").glob("*/run_meta.json"))
    recorded = {folder.name: json.loads((folder / "run_meta.json").read_text())["settings"] for folder in folders}
    assert {name: (s["config"]["method"], s["config"]["observation"]) for name, s in recorded.items()} == {
        "fullkv_agnostic_multi": ("fullkv", "window"),
        "snapkv_64_agnostic_multi": ("snapkv", "window"),
        "snapkv_64_reconstruction_agnostic_multi": ("snapkv", "reconstruction"),
        "kvzip_64_agnostic_multi": ("kvzip", "reconstruction"),
    }
    assert all(s["query_agnostic"] and s["benchmark_flags"]["multi_question"] and s["max_new_tokens"] == 3
               for s in recorded.values())
    for folder in folders:  # each context compressed to 64 tokens (fullkv: kept whole), then question and answer
        for task in ("niah_single_1", "niah_multikey_1"):
            for line in read_predictions(folder / "400", task):
                kept = line["context_tokens"] if folder.name.startswith("fullkv") else 64
                assert line["kv_tokens_stored"] == kept + line["question_tokens"] + line["new_tokens"] - 1
    assert sweep.report(args, rows).splitlines()[0] == (
        "RULER 400 tokens, 1 samples per task, smollm2-135m, query-agnostic, one question per needle")

