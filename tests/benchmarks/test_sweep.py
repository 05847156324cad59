"""The README's budget sweep: flags, labels, and one small end-to-end run on the embedded model."""

import csv
import json
import shutil

import pytest

from restkv.benchmarks import sweep, tables
from restkv.benchmarks.results import read_predictions
from restkv.config import ConfigError


def test_method_specs_become_runner_flags():
    assert sweep.method_flags("snapkv") == ["--method", "snapkv"]
    assert sweep.method_flags("adakv+residual+residual_no_gate") == [  # the folder names --residual itself
        "--method", "adakv", "--residual", "--residual_no_gate", "--tag", "residual_no_gate"]
    with pytest.raises(ConfigError, match="'bogus' is not a boolean option"):
        sweep.method_flags("snapkv+bogus")


def test_budget_labels():
    args = sweep.build_parser().parse_args([])
    assert [sweep.budget_label(flags) for flags in sweep.budget_flags(args)] == ["10%", "20%"]
    args = sweep.build_parser().parse_args(["--budgets", "256", "512"])
    assert [sweep.budget_label(flags) for flags in sweep.budget_flags(args)] == ["256", "512"]
    assert sweep.budget_label([]) == "full"


def test_the_default_compares_the_namesake_kvzip_and_a_cheap_query_agnostic_method_in_both_settings():
    args = sweep.parse_args([])
    runs = sweep.configurations(args)
    assert len(runs) == 2 * (1 + 2 * len(sweep.DEFAULT_METHODS))
    assert {agnostic for agnostic, _, _ in runs} == {False, True}
    assert {spec for _, spec, _ in runs} == {"fullkv", "streamingllm", "snapkv", "restkv", "restkv_recon", "kvzip",
                                            "learned_zip"}
    assert {sweep.budget_label(budget) for _, _, budget in runs} == {"full", "10%", "20%"}
    assert sweep.runner_args(args, "fullkv", [], True).max_new_tokens == 32  # a lost needle does not ramble on
    assert {agnostic for agnostic, _, _ in sweep.configurations(sweep.parse_args(["--query_aware"]))} == {False}
    assert {agnostic for agnostic, _, _ in sweep.configurations(sweep.parse_args(["--query_agnostic"]))} == {True}


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
        (["--multi_question", "--query_aware"], "--multi_question compresses each context before its questions"),
        (["--query_aware", "--query_agnostic"], "not allowed with argument"),
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


def averages(rows):
    """(setting, method, budget, samples) of each configuration's average row."""
    return [(row["setting"], tables.label(row), tables.budget_label(row), f"{row['n']}/{row['expected']}")
            for row in rows if row["task"] == tables.AVERAGE]


@pytest.mark.embedded
def test_a_small_sweep_runs_every_configuration_and_reports_what_the_cache_kept(smollm2, tmp_path, capsys):
    model, tokenizer = smollm2
    argv = ["--length", "512", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "streamingllm",
            "snapkv", "snapkv+residual", "--budgets", "64", "--query_aware", "--save_dir", str(tmp_path)]
    rows = sweep.run_sweep(sweep.build_parser().parse_args(argv), model=model, tokenizer=tokenizer)
    assert [(method, budget) for _, method, budget, _ in averages(rows)] == [
        ("fullkv", "full"), ("streamingllm", "64"), ("snapkv", "64"), ("snapkv+residual", "64")]
    assert rows[0]["kv_kept"] == 1.0
    for row in rows[2:]:
        assert row["kv_kept"] < 0.25  # 64 of ~500 tokens per layer, tail included
        assert 0 <= row["score"] <= 100
    # A rerun finds every sample written and recomputes nothing (each line records its own timing).
    written = {path: path.read_text() for path in tmp_path.rglob("*.jsonl") if "data" not in path.parts}
    assert len(written) == 4  # the residual run has its own folder
    again = sweep.run_sweep(sweep.build_parser().parse_args(argv), model=model, tokenizer=tokenizer)
    assert again == rows
    assert {path: path.read_text() for path in written} == written


def test_a_sharded_sweep_marks_every_score_that_stands_on_part_of_the_samples(tmp_path, tiny, tokenizer):
    """Shard 0 of 2 holds 1 of each task's 2 samples: its table must not read as a full one."""
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "2", "--methods", "snapkv",
            "--budgets", "64", "--query_aware", "--save_dir", str(tmp_path), "--num_shards", "2", "--shard_id", "0"]
    args = sweep.build_parser().parse_args(argv)
    rows = sweep.run_sweep(args, model=tiny, tokenizer=tokenizer)
    assert [samples for *_, samples in averages(rows)] == ["1/2", "1/2"]
    table = sweep.report(args, rows).splitlines()
    assert table[0] == "RULER 400 tokens, 2 samples per task (shard 0 of 2), smollm2-135m, query-aware"
    assert table[1].split() == ["method", "budget", "niah_single_1", "avg", "±", "stderr", "kv", "kept", "samples"]
    assert table[2].split()[2:4] == [f"{rows[0]['score']:.2f}*"] * 2 and table[2].split()[-1] == "1/2"
    assert "* fullkv full (query-aware) / 400/niah_single_1: 1/2 samples" in table


def test_the_main_command_writes_one_table_and_figure_and_a_partial_rerun_cannot_shrink_them(
        tmp_path, tiny, tokenizer, monkeypatch, capsys):
    """Both settings in one table; the progress bar counts runs across the sweep; a rerun of one
    shard (fewer samples) merges into the table instead of replacing it, and shows no empty bars."""
    import restkv.integrations.transformers.models as models

    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: tiny)
    monkeypatch.setattr(models, "load_tokenizer", lambda *args, **kwargs: tokenizer)
    argv = ["--length", "400", "--tasks", "niah_single_1,niah_multikey_1", "--num_samples", "2", "--methods",
            "snapkv", "--compression_ratios", "0.8", "--max_new_tokens", "3", "--save_dir", str(tmp_path)]
    rows = sweep.main(argv)
    out, err = capsys.readouterr()
    assert averages(rows) == [(setting, method, budget, "4/4") for setting in ("query-aware", "query-agnostic")
                              for method, budget in (("fullkv", "full"), ("snapkv", "20%"))]
    assert "run 1 of 4: fullkv full" in err and "run 4 of 4: snapkv 20%" in err
    assert [line for line in out.splitlines() if line.startswith("RULER 400 tokens")] == [
        "RULER 400 tokens, 2 samples per task, smollm2-135m, query-aware",
        "RULER 400 tokens, 2 samples per task, smollm2-135m, query-agnostic"]
    stem = tmp_path / "sweep_400_table"
    saved = json.loads((stem.parent / "sweep_400_table.json").read_text())["rows"]
    assert saved == rows and len(saved) == 12  # 4 runs x (2 tasks + average)
    with open(stem.parent / "sweep_400_table.csv", newline="") as handle:
        assert [float(line["kv_kept"]) for line in csv.DictReader(handle)][:3] == [1.0, 1.0, 1.0]
    assert (stem.parent / "sweep_400_table.png").read_bytes()[:4] == b"\x89PNG"
    assert f"figure: {stem.parent / 'sweep_400_table.png'}" in out

    shutil.rmtree(tmp_path / "len400" / "smollm2-135m" / "snapkv_ratio0.8")  # its predictions lost: rerun one shard
    partial = sweep.main([*argv, "--query_aware", "--num_shards", "2", "--shard_id", "0"])
    err = capsys.readouterr().err
    assert [row["n"] for row in partial if row["task"] == tables.AVERAGE] == [4, 2]  # the rerun: half the samples
    assert json.loads((stem.parent / "sweep_400_table.json").read_text())["rows"] == rows
    assert "400/niah_single_1 [0/2]" in err and "400/niah_single_1:" not in err  # no empty bar for fullkv


def test_a_budget_smaller_than_the_template_kvzip_keeps_answers_with_the_full_cache_and_says_so(
        tmp_path, tiny, tokenizer):
    """Query-aware KVzip keeps the question and template around the context: at 10% of a short
    prompt they fill the budget, which stopped the default sweep at its fifth run."""
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "1", "--methods", "kvzip",
            "--compression_ratios", "0.9", "--query_aware", "--max_new_tokens", "3", "--save_dir", str(tmp_path)]
    args = sweep.parse_args(argv)
    rows = sweep.run_sweep(args, model=tiny, tokenizer=tokenizer)
    kvzip = [row for row in rows if row["method"] == "kvzip" and row["task"] != tables.AVERAGE]
    assert [(row["uncompressed"], row["n"], row["kv_kept"]) for row in kvzip] == [(1, 1, 1.0)]
    assert ("  kvzip 10% (query-aware) / 400/niah_single_1: 1 of 1 samples answered with the full cache "
            "(prompt too short for the ratio budget)") in sweep.report(args, rows).splitlines()


def test_an_old_sweep_json_is_refused_before_anything_runs(tmp_path, capsys, no_model_loading):
    (tmp_path / "sweep_400_table.json").write_text(json.dumps([{"method": "snapkv", "kv kept": "0.13"}]))
    with pytest.raises(SystemExit):
        sweep.main(["--length", "400", "--save_dir", str(tmp_path)])
    assert "sweep_400_table.json: not a results table of this version" in capsys.readouterr().err
    assert [path.name for path in tmp_path.iterdir()] == ["sweep_400_table.json"]


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
    multi = "query-agnostic, one question per needle"
    assert averages(rows) == [(multi, "fullkv", "full", "5/5"), (multi, "snapkv", "64", "5/5"),
                              (multi, "snapkv+observation=reconstruction", "64", "5/5"), (multi, "kvzip", "64", "5/5")]
    folders = sorted(path.parent for path in (tmp_path / "len400" / "smollm2-135m").glob("*/run_meta.json"))
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



def test_sweeps_at_two_lengths_share_one_save_dir_and_one_table_each(tmp_path, tiny, tokenizer):
    """A RULER run folder records its prompt limit (the length), so the runs of each length live in their own
    folder under the sweep's --save_dir; the second length runs instead of being refused."""
    for length in ("400", "500"):
        args = sweep.parse_args(["--length", length, "--tasks", "niah_single_1", "--num_samples", "1", "--methods",
                                 "snapkv", "--budgets", "64", "--query_aware", "--max_new_tokens", "2",
                                 "--save_dir", str(tmp_path)])
        rows = sweep.run_sweep(args, model=tiny, tokenizer=tokenizer)
        assert [samples for *_, samples in averages(rows)] == ["1/1", "1/1"]
        assert (tmp_path / f"len{length}" / "smollm2-135m" / "snapkv_64" / length / "niah_single_1.jsonl").is_file()
