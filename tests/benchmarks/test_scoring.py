"""Scoring run folders, the same way for every benchmark, and the tables the evaluators print."""

from __future__ import annotations

import dataclasses
import json

import pytest
from toy_benchmark import TOY, lines_of, toy_run, toy_score

from restkv.benchmarks import longbench, scoring, tables
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.scoring import DatasetScore


def write_lines(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def test_format_table():
    table = scoring.format_table([{"run": "a", "x": 1.234, "y": None}, {"run": "bb", "x": float("nan"), "y": 2.0}],
                                ["x", "y"])
    assert table.splitlines() == ["run     x     y", "a    1.23     -", "bb      -  2.00"]


def test_a_run_stopped_early_is_scored_with_its_counts_and_marked(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer)
    records = lines_of(folder / "logs.jsonl")
    write_lines(folder / "logs.jsonl", records[:3])  # the run stopped after 3 of its 5 samples
    (run,) = scoring.evaluate(TOY, tmp_path)
    expected = round(100 * sum(r["answers"][0] in r["pred"] for r in records[:3]) / 3, 2)
    assert run.label == "smollm2-135m/snapkv_48" and run.complete is False
    assert run.datasets == {"logs": DatasetScore(expected, 3, 5)}
    written = json.loads((folder / "scores.json").read_text())
    per_sample = [100.0 * (r["answers"][0] in r["pred"]) for r in records[:3]]
    kept = sum(r["kv_tokens_stored"] for r in records[:3]) / sum(r["kv_tokens_seen"] for r in records[:3])
    assert written == {
        "benchmark": "toy",
        "datasets": {"logs": {"score": expected, "samples_scored": 3, "samples_expected": 5, "complete": False,
                              "samples_uncompressed": 0, "stderr": tables.stderr(per_sample),
                              "kv_kept": round(kept, 4)}},
        "average": expected, "averaged_over": ["logs"], "complete": False,
    }
    table = scoring.runs_table([run]).splitlines()
    assert table[0].split() == ["run", "logs", "average", "samples"]
    assert table[1].split() == ["smollm2-135m/snapkv_48", f"{expected:.2f}*", f"{expected:.2f}*", "3/5"]
    assert table[2] == "* smollm2-135m/snapkv_48 / logs: 3/5 samples"


def test_complete_runs_are_unmarked_and_other_tools_files_have_no_expected_count(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2")
    write_lines(tmp_path / "official" / "logs.jsonl", [{"pred": "4000", "answers": ["4000"]}])
    runs = scoring.evaluate(TOY, tmp_path)
    assert [run.folder for run in runs] == [tmp_path / "official", folder]
    assert runs[0].datasets["logs"] == DatasetScore(100.0, 1, None) and runs[0].complete is None
    assert runs[1].complete is True
    table = scoring.runs_table(runs)
    assert "*" not in table and table.splitlines()[1].split()[-1] == "1/?"
    assert table.splitlines()[2].split()[-1] == "2/2"


def test_samples_answered_with_the_full_cache_are_counted(tmp_path):
    write_lines(tmp_path / "run" / "logs.jsonl", [
        {"id": "a", "pred": "1", "answers": ["1"]},
        {"id": "b", "pred": "2", "answers": ["1"], "compressed": False, "uncompressed_reason": "short"},
    ])
    (run,) = scoring.evaluate(TOY, tmp_path / "run")
    assert run.datasets["logs"].uncompressed == 1
    assert "run / logs: 1 of 2 samples answered with the full cache" in scoring.runs_table([run])
    assert json.loads((tmp_path / "run" / "scores.json").read_text())["datasets"]["logs"]["samples_uncompressed"] == 1


def test_run_folders_are_found_by_their_benchmark_and_layout(tmp_path):
    for name, benchmark in (("toy_run", "toy"), ("other_run", "ruler")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_meta.json").write_text(json.dumps({"settings": {"benchmark": benchmark}}))
        write_lines(tmp_path / name / "600" / "logs.jsonl", [{"id": "a", "pred": "1", "answers": ["1"]}])
    write_lines(tmp_path / "plain" / "logs.jsonl", [{"pred": "1", "answers": ["1"]}])
    write_lines(tmp_path / "foreign" / "hotpotqa.jsonl", [{"pred": "1", "answers": ["1"]}])
    assert scoring.find_run_folders(tmp_path, TOY) == [tmp_path / "plain", tmp_path / "toy_run"]
    # Files of no known dataset are another benchmark's, unless the folder is the one asked for.
    assert scoring.find_run_folders(tmp_path / "foreign", TOY) == [tmp_path / "foreign"]
    nested = dataclasses.replace(TOY, prediction_glob="[0-9]*/*.jsonl")
    assert scoring.find_run_folders(tmp_path, nested) == [tmp_path / "toy_run"]
    assert scoring.score_run(tmp_path / "toy_run", nested).datasets == {"600/logs": DatasetScore(100.0, 1, None)}
    with pytest.raises(DataError, match="no such folder"):
        scoring.find_run_folders(tmp_path / "typo", TOY)


def test_nothing_to_score_is_an_error(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1")
    (folder / "logs.jsonl").write_text("")
    with pytest.raises(DataError, match="nothing to score: the toy runs there hold no predictions yet"):
        scoring.evaluate(TOY, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no prediction files of toy runs found"):
        scoring.evaluate(TOY, tmp_path / "empty")


def test_marks_and_sample_counts():
    complete, partial, unknown = DatasetScore(50.0, 4, 4), DatasetScore(50.0, 3, 4), DatasetScore(1.0, 2, None)
    assert scoring.marked(50.0, [complete]) == 50.0
    assert scoring.marked(50.0, [complete, partial]) == "50.00*"
    assert scoring.marked(None, [DatasetScore(None, 0, 4)]) == "-*"
    assert scoring.samples_cell([complete, partial]) == "7/8"
    assert scoring.samples_cell([complete, unknown]) == "6/?"


def test_a_line_the_metric_cannot_read_is_reported_with_its_folder(tmp_path):
    def strict(dataset, records):
        raise DataError(f"{dataset}: the prediction of id 'a' lacks field 'answers'")

    write_lines(tmp_path / "run" / "logs.jsonl", [{"id": "a", "pred": "1"}])
    with pytest.raises(DataError, match=f"^{tmp_path / 'run'}: logs: the prediction of id 'a' lacks field"):
        scoring.evaluate(dataclasses.replace(TOY, score=strict), tmp_path)



# --------------------------------------------------------------------------- the combined table


def test_every_evaluation_writes_all_its_runs_as_one_numeric_table_that_a_partial_rescore_cannot_shrink(
        tmp_path, tiny, tokenizer, capsys):
    folder = toy_run(tmp_path, tiny, tokenizer)
    toy_run(tmp_path, tiny, tokenizer, "--method", "fullkv", "--query_agnostic")
    scoring.evaluate(TOY, tmp_path)
    assert "every run as one table" in capsys.readouterr().err
    saved = json.loads((tmp_path / "score_table.json").read_text())["rows"]
    records = lines_of(folder / "logs.jsonl")
    by_run = {(row["method"], row["setting"], row["task"]): row for row in saved}
    snap = by_run[("snapkv", "query-aware", "logs")]
    assert (snap["benchmark"], snap["budget"], snap["compression_ratio"], snap["options"]) == ("toy", 48, None, None)
    assert (snap["n"], snap["expected"]) == (5, 5) and snap["score"] == toy_score("logs", records)
    assert snap["stderr"] == tables.stderr([toy_score("logs", [record]) for record in records])
    assert 0 < snap["kv_kept"] < 1 and by_run[("fullkv", "query-agnostic", "logs")]["kv_kept"] == 1.0
    assert by_run[("snapkv", "query-aware", "average")]["score"] == snap["score"]
    assert (tmp_path / "score_table.csv").is_file() and (tmp_path / "score_table.png").is_file()

    write_lines(folder / "logs.jsonl", records[:2])  # predictions lost: the rescore stands on 2 of 5
    scoring.evaluate(TOY, tmp_path)
    assert json.loads((tmp_path / "score_table.json").read_text())["rows"] == saved


def test_a_run_folder_name_gives_the_rows_options_and_setting(tmp_path):
    folder = tmp_path / "m" / "snapkv_ratio0.9_residual_no_gate_reconstruction_agnostic_multi"
    folder.mkdir(parents=True)
    settings = {"benchmark": "ruler", "model_path": "m", "query_agnostic": True,
                "benchmark_flags": {"multi_question": True},
                "config": {"method": "snapkv", "compression_ratio": 0.9, "max_capacity_prompts": None}}
    (folder / "run_meta.json").write_text(json.dumps({"settings": settings}))
    assert scoring.run_fields(folder, "label") == {
        "benchmark": "ruler", "model": "m", "setting": "query-agnostic, one question per needle",
        "method": "snapkv", "options": "residual_no_gate_reconstruction", "budget": None,
        "compression_ratio": 0.9, "run": str(folder)}
    assert scoring.run_fields(tmp_path / "plain", "plain")["method"] == "plain"  # no runner wrote it


def test_the_longbench_evaluation_writes_strict_json(tmp_path):
    """A run without an average wrote a bare NaN into metrics.json and results.json."""
    write_lines(tmp_path / "snapkv_64" / "hotpotqa.jsonl",
                [{"id": "a", "pred": "Vienna", "answers": ["Vienna"], "all_classes": None, "length": 10}])
    waiting = tmp_path / "fullkv"
    waiting.mkdir()
    expected = {"fingerprint": "0" * 64, "samples_in_data": 1, "samples_expected": 1}
    (waiting / "run_meta.json").write_text(json.dumps({"settings": {"benchmark": "longbench"},
                                                       "datasets": {"hotpotqa": expected}}))
    longbench.evaluate_results_dir(tmp_path)

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    results = json.loads((tmp_path / "results.json").read_text(), parse_constant=refuse)
    assert results["fullkv"]["average"] is None and results["snapkv_64"]["average"] == 100.0
    assert json.loads((waiting / "metrics.json").read_text(), parse_constant=refuse)["average"] is None
    json.loads((tmp_path / "score_table.json").read_text(), parse_constant=refuse)
