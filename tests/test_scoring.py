"""Scoring run folders and the tables the evaluators print."""

from __future__ import annotations

from restkv.benchmarks import scoring


def test_format_table():
    table = scoring.format_table([{"run": "a", "x": 1.234, "y": None}, {"run": "bb", "x": float("nan"), "y": 2.0}],
                                ["x", "y"])
    assert table.splitlines() == ["run     x     y", "a    1.23     -", "bb      -  2.00"]
