"""Results as one table: numeric rows, a strict JSON, a CSV, merging instead of overwriting, the figure."""

from __future__ import annotations

import csv
import json
import math

import pytest

from restkv.benchmarks import tables
from restkv.benchmarks.errors import DataError


def row(method, task, score, n=4, ratio=0.9, kv_kept=0.1, setting=tables.QUERY_AWARE, stderr=5.0, options=None):
    return {"benchmark": "ruler", "model": "m", "setting": setting, "method": method, "options": options,
            "budget": None, "compression_ratio": None if method == "fullkv" else ratio,
            "kv_kept": 1.0 if method == "fullkv" else kv_kept, "task": task, "score": score, "n": n, "expected": 4,
            "stderr": stderr, "uncompressed": 0, "run": f"runs/{method}"}


def nine_rows():
    return [row(method, task, 50.0) for method in ("fullkv", "snapkv", "kvzip") for task in ("a", "b", tables.AVERAGE)]


def test_the_json_is_strict_and_the_numbers_are_numbers(tmp_path):
    rows = [row("snapkv", "a", float("nan"), stderr=float("inf")), row("kvzip", "a", 75.0)]
    merged, json_path, csv_path = tables.write_table(rows, tmp_path / "t")
    text = json_path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert data["format"] == tables.FORMAT and data["columns"] == list(tables.COLUMNS)
    assert data["rows"][0]["score"] is None and data["rows"][0]["stderr"] is None
    assert data["rows"][1]["score"] == 75.0 and data["rows"][1]["n"] == 4 and data["rows"][1]["kv_kept"] == 0.1
    with open(csv_path, newline="") as handle:
        lines = list(csv.DictReader(handle))
    assert list(lines[0]) == list(tables.COLUMNS)
    assert lines[0]["score"] == "" and float(lines[1]["score"]) == 75.0 and int(lines[1]["n"]) == 4
    assert tables.strict_json({"x": [math.nan, 1.5]}, indent=None) == '{"x": [null, 1.5]}'


def test_a_partial_rerun_merges_into_the_fuller_table_instead_of_overwriting_it(tmp_path):
    """Today's bug: a rerun of two rows replaced a table of nine."""
    tables.write_table(nine_rows(), tmp_path / "t")
    rerun = [row("snapkv", "a", 100.0, n=2), row("kvzip", "a", 25.0, n=4)]
    merged, json_path, _ = tables.write_table(rerun, tmp_path / "t")
    assert len(merged) == 9 and len(json.loads(json_path.read_text())["rows"]) == 9
    scores = {(r["method"], r["task"]): (r["score"], r["n"]) for r in merged}
    assert scores[("snapkv", "a")] == (50.0, 4)  # the rerun scored fewer samples: the fuller row stays
    assert scores[("kvzip", "a")] == (25.0, 4)  # as many samples: the newer row wins
    added, _, _ = tables.write_table([row("snapkv", "a", 60.0, ratio=0.8)], tmp_path / "t")
    assert len(added) == 10  # another budget is another row


def test_a_file_of_another_layout_is_refused_not_dropped(tmp_path):
    old = tmp_path / "t.json"
    old.write_text(json.dumps([{"method": "snapkv", "budget": "256", "kv kept": "0.13"}]))
    with pytest.raises(DataError, match="t.json: not a results table of this version"):
        tables.write_table([row("snapkv", "a", 1.0)], tmp_path / "t")
    assert json.loads(old.read_text())[0]["kv kept"] == "0.13"
    old.write_text("{broken")
    with pytest.raises(DataError, match="t.json: not valid JSON"):
        tables.read_rows(old)


def test_labels_and_standard_errors():
    assert tables.label(row("snapkv", "a", 1.0, options="residual")) == "snapkv+residual"
    assert tables.budget_label(row("snapkv", "a", 1.0, ratio=0.8)) == "20%"
    assert tables.budget_label(row("fullkv", "a", 1.0)) == "full"
    assert tables.budget_label({**row("snapkv", "a", 1.0), "compression_ratio": None, "budget": 256}) == "256"
    assert tables.stderr([0.0, 100.0, 100.0, 100.0]) == 25.0 and tables.stderr([50.0]) is None


def test_the_figure_draws_every_method_with_its_own_marker_and_error_bars(tmp_path):
    """Two methods with equal scores at equal budgets stay apart (their markers differ)."""
    rows = [row("fullkv", tables.AVERAGE, 90.0, stderr=2.0)]
    for setting in (tables.QUERY_AWARE, tables.QUERY_AGNOSTIC):
        for ratio, kept in ((0.9, 0.1), (0.8, 0.2)):
            rows += [row(method, tables.AVERAGE, 40.0, ratio=ratio, kv_kept=kept, setting=setting)
                     for method in ("snapkv", "kvzip")]
    rows.append(row("snapkv", "a", 10.0))  # a task's row: not drawn, only averages are
    figure = tables.score_figure(rows, tmp_path / "f.png", title="t")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    aware, agnostic = figure.axes[:2]
    assert [aware.get_title(), agnostic.get_title()] == ["ruler query-aware", "ruler query-agnostic"]
    series = {container.get_label(): container for container in aware.containers}
    assert set(series) == {"fullkv", "snapkv", "kvzip"} and all(c.has_yerr for c in series.values())
    lines = {name: container.lines[0] for name, container in series.items()}
    assert len({line.get_marker() for line in lines.values()}) == 3
    assert list(lines["snapkv"].get_xdata()) == [0.1, 0.2] and list(lines["kvzip"].get_ydata()) == [40.0, 40.0]
    assert [c.get_label() for c in agnostic.containers] == ["snapkv", "kvzip"]
    assert any(line.get_linestyle() == "--" for line in aware.get_lines())  # the full cache across the panel
    with pytest.raises(ValueError, match="no averaged scores"):
        tables.score_figure([{**rows[0], "kv_kept": None}], tmp_path / "g.png")


def test_write_results_writes_the_table_and_its_figure_beside_it(tmp_path):
    written = tables.write_results(nine_rows(), tmp_path / "sweep_0.5_table")
    assert sorted(path.name for path in written.values()) == [
        "sweep_0.5_table.csv", "sweep_0.5_table.json", "sweep_0.5_table.png"]
    assert all(path.is_file() for path in written.values())
    no_cache_report = [{**r, "kv_kept": None} for r in nine_rows()]
    assert set(tables.write_results(no_cache_report, tmp_path / "other")) == {"json", "csv"}


def test_answer_nll_writes_its_results_as_the_same_table(tiny, tokenizer, tmp_path):
    from top_level import load_scripts_module

    answer_nll = load_scripts_module("answer_nll")
    argv = ["--length", "400", "--tasks", "niah_single_1", "--num_samples", "2", "--methods", "snapkv",
            "--compression_ratios", "0.8", "--settings", "agnostic", "--save_dir", str(tmp_path)]
    records = answer_nll.main(argv, model=tiny, tokenizer=tokenizer)
    saved = tables.read_rows(tmp_path / "answer_nll_table.json")
    by_config = {(row["method"], row["compression_ratio"], row["task"]): row for row in saved}
    snap = [record["nll"] for record in records if record["method"] == "snapkv"]
    task = by_config[("snapkv", 0.8, "400/niah_single_1")]
    assert task["score"] == round(sum(snap) / 2, 4) and task["stderr"] == tables.stderr(snap)
    assert (task["n"], task["expected"], task["setting"]) == (2, 2, "query-agnostic")
    assert by_config[("fullkv", None, tables.AVERAGE)]["n"] == 2
