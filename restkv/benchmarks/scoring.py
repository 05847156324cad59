"""Scores of run folders, the same way for every benchmark, and the tables the evaluators print.

``evaluate(benchmark, results_dir)`` finds the run folders (``find_run_folders``), scores every
dataset of each with the benchmark's metric (``Benchmark.score``) and writes ``scores.json`` in
every run folder::

    {"benchmark": "ruler",
     "datasets": {"4096/vt": {"score": 87.5, "samples_scored": 3, "samples_expected": 4,
                              "complete": false, "samples_uncompressed": 0, "stderr": 12.5,
                              "kv_kept": 0.11}, ...},
     "average": 87.5, "averaged_over": ["4096/vt"], "complete": false}

``samples_expected`` comes from the run's ``run_meta.json`` (null, and ``complete`` null, for
files another tool wrote); ``samples_uncompressed`` counts samples answered with the full cache
because their prompt was too short for a ratio budget; ``stderr`` is the standard error of the
mean of the per-sample scores and ``kv_kept`` the share of the prompt's tokens the caches held.
``evaluate`` also writes every run as rows of one table in ``results_dir``
(``score_table.csv`` / ``.json`` / ``.png``: ``table_rows``, ``restkv.benchmarks.tables``).
Every table built here or by an evaluator marks a cell that stands on fewer samples than
expected with ``*``, says how many samples it scored (``samples`` column), and ends with a
footnote per incomplete cell.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from restkv.benchmarks import tables
from restkv.benchmarks.benchmark import Benchmark
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.results import SHARD_INFIX, datasets_in, read_predictions
from restkv.benchmarks.run_folder import META_FILE, read_run_meta

SCORES_FILE = "scores.json"
INCOMPLETE = "*"


@dataclass(frozen=True)
class DatasetScore:
    """One dataset of one run: the score over the predictions present, and how many there are.

    score: None when the dataset has no prediction yet; expected: None when no runner recorded
    it; uncompressed: samples answered with the full cache (prompt too short to compress);
    stderr: of the mean of the per-sample scores; kv_seen/kv_stored: the prompt tokens the
    samples' caches saw and held (summed; zero for files no runner wrote). The last three are
    measurements of the same predictions, left out of equality.
    """

    score: float | None
    scored: int
    expected: int | None
    uncompressed: int = 0
    stderr: float | None = field(default=None, compare=False)
    kv_seen: int = field(default=0, compare=False)
    kv_stored: float = field(default=0.0, compare=False)

    @property
    def kv_kept(self) -> float | None:
        """The share of the prompt's tokens the cache held (None without cache reports)."""
        return round(self.kv_stored / self.kv_seen, 4) if self.kv_seen else None

    @property
    def complete(self) -> bool | None:
        return None if self.expected is None else self.scored >= self.expected

    def to_json(self) -> dict[str, Any]:
        return {"score": self.score, "samples_scored": self.scored, "samples_expected": self.expected,
                "complete": self.complete, "samples_uncompressed": self.uncompressed, "stderr": self.stderr,
                "kv_kept": self.kv_kept}


@dataclass(frozen=True)
class RunScores:
    """Every dataset of one run folder; ``label`` names the folder in tables (its path below
    the evaluated folder)."""

    folder: Path
    label: str
    datasets: dict[str, DatasetScore]
    average: float | None
    averaged_over: list[str]

    @property
    def complete(self) -> bool | None:
        flags = [score.complete for score in self.datasets.values()]
        return None if None in flags else all(flags)

    def to_json(self, benchmark: Benchmark) -> dict[str, Any]:
        return {"benchmark": benchmark.name, "datasets": {n: s.to_json() for n, s in self.datasets.items()},
                "average": self.average, "averaged_over": self.averaged_over, "complete": self.complete}


def find_run_folders(results_dir: str | Path, benchmark: Benchmark) -> list[Path]:
    """The run folders of ``benchmark`` at or below ``results_dir``.

    A run folder is one whose ``run_meta.json`` names the benchmark, or, for prediction files
    that no runner wrote (LongBench's own pred.py output), a folder outside every run folder
    whose files lie as ``benchmark.prediction_glob`` says and name one of the benchmark's
    datasets (any name when the folder is ``results_dir`` itself).
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise DataError(f"--results_dir {root}: no such folder")
    claimed = {path.parent for path in root.rglob(META_FILE)}
    runs = {folder for folder in claimed
            if (read_run_meta(folder) or {}).get("settings", {}).get("benchmark") == benchmark.name}
    depth = len(Path(benchmark.prediction_glob).parts)
    for path in root.rglob("*.jsonl"):
        if len(path.relative_to(root).parts) < depth or claimed & {path.parent, *path.parents}:
            continue
        folder = path.parents[depth - 1]
        base = path.name[: -len(".jsonl")].split(SHARD_INFIX)[0]
        if path.relative_to(folder).match(benchmark.prediction_glob) and (
                folder == root or base in benchmark.datasets):
            runs.add(folder)
    return sorted(runs)


def score_run(folder: Path, benchmark: Benchmark, datasets: Sequence[str] | None = None,
              label: str | None = None) -> RunScores:
    """Score every dataset of a run folder (those with prediction files and those its
    ``run_meta.json`` expects), optionally only ``datasets``; writes ``scores.json``."""
    recorded = (read_run_meta(folder) or {}).get("datasets", {})
    names = set(datasets_in(folder, benchmark.prediction_glob)) | set(recorded)
    if datasets is not None:
        names &= set(datasets)
    scores = {}
    for name in sorted(names, key=lambda name: _dataset_order(benchmark, name)):
        records = read_predictions(folder, name)
        try:
            score = benchmark.score(name, records) if records else None
            per_sample = [benchmark.score(name, [record]) for record in records]
        except DataError as error:
            raise DataError(f"{folder}: {error}") from None
        scores[name] = DatasetScore(
            score=score,
            scored=len(records),
            expected=recorded.get(name, {}).get("samples_expected"),
            uncompressed=sum(record.get("compressed") is False for record in records),
            stderr=tables.stderr(per_sample),
            kv_seen=sum(record.get("kv_tokens_seen", 0) for record in records),
            kv_stored=sum(record.get("kv_tokens_stored", 0) for record in records),
        )
    scored = [name for name, score in scores.items() if score.score is not None]
    averaged = benchmark.average_over(scored) if benchmark.average_over is not None else scored
    average = round(statistics.fmean(scores[name].score for name in averaged), 2) if averaged else None
    run = RunScores(folder, label or folder.name, scores, average, averaged)
    (folder / SCORES_FILE).write_text(json.dumps(run.to_json(benchmark), indent=2) + "\n", encoding="utf-8")
    return run


def evaluate(benchmark: Benchmark, results_dir: str | Path, datasets: Sequence[str] | None = None) -> list[RunScores]:
    """Score every run folder of ``benchmark`` at or below ``results_dir`` (``scores.json`` in each).

    Raises ``DataError`` when there is no run folder, or when no run holds a single prediction.
    """
    root = Path(results_dir)
    folders = find_run_folders(root, benchmark)
    if not folders:
        raise DataError(f"{root}: no prediction files of {benchmark.name} runs found")
    runs = [score_run(folder, benchmark, datasets, folder.name if folder == root else str(folder.relative_to(root)))
            for folder in folders]
    if not any(score.scored for run in runs for score in run.datasets.values()):
        raise DataError(f"{root}: nothing to score: the {benchmark.name} runs there hold no predictions yet "
                        f"({', '.join(run.label for run in runs)})")
    written = tables.write_results([row for run in runs for row in table_rows(run, benchmark)],
                                   root / TABLE_STEM, title=f"{benchmark.name}: {root}")
    # on stderr, beside the progress bars: stdout holds the evaluator's own tables
    print(f"(every run as one table: {', '.join(str(path) for path in written.values())})", file=sys.stderr)
    return runs


TABLE_STEM = "score_table"


def run_fields(folder: Path, label: str) -> dict[str, Any]:
    """What a run folder's table rows say of the run: benchmark, model, setting, method, the
    options its folder name adds (``snapkv_128_residual_agnostic`` -> ``residual``) and its
    budget, from its ``run_meta.json``; a folder no runner wrote is named by ``label``."""
    settings = (read_run_meta(folder) or {}).get("settings", {})
    config = settings.get("config", {})
    method = config.get("method")
    if method is None:
        return {"method": label, "run": str(folder)}
    ratio, budget = config.get("compression_ratio"), config.get("max_capacity_prompts")
    multi = (settings.get("benchmark_flags") or {}).get("multi_question")
    in_name = {"agnostic"} if settings.get("query_agnostic") else set()
    in_name |= {"multi"} if multi else set()
    rest = folder.name[len(method):] if folder.name.startswith(method) else folder.name
    budget_part = "" if method == "fullkv" else str(budget) if ratio is None else f"ratio{ratio:g}"
    parts = [part for part in rest.split("_") if part]
    if budget_part and parts[:1] == [budget_part]:
        parts = parts[1:]
    for part in in_name & set(parts):
        parts.remove(part)
    setting = tables.QUERY_AGNOSTIC if settings.get("query_agnostic") else tables.QUERY_AWARE
    return {"benchmark": settings.get("benchmark"), "model": settings.get("model_path"),
            "setting": setting + (", one question per needle" if multi else ""), "method": method,
            "options": "_".join(parts) or None, "budget": None if method == "fullkv" or ratio is not None else budget,
            "compression_ratio": None if method == "fullkv" else ratio, "run": str(folder)}


def table_rows(run: RunScores, benchmark: Benchmark, fields: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """A run as rows of the results table (``restkv.benchmarks.tables``): one per scored dataset,
    then its ``average`` (over ``run.averaged_over``; stderr from the datasets' own, as
    independent means). ``fields`` (default ``run_fields``) say what the run is."""
    described = {"benchmark": benchmark.name, **(fields if fields is not None else run_fields(run.folder, run.label))}

    def row(task: str, score: float | None, scores: Sequence[DatasetScore], error: float | None) -> dict[str, Any]:
        seen = sum(one.kv_seen for one in scores)
        expected = [one.expected for one in scores]
        return {**described, "task": task, "score": score, "n": sum(one.scored for one in scores),
                "expected": None if None in expected else sum(expected), "stderr": error,
                "kv_kept": round(sum(one.kv_stored for one in scores) / seen, 4) if seen else None,
                "uncompressed": sum(one.uncompressed for one in scores)}

    rows = [row(name, one.score, [one], one.stderr) for name, one in run.datasets.items() if one.score is not None]
    averaged = [run.datasets[name] for name in run.averaged_over]
    if averaged:
        errors = [one.stderr for one in averaged]
        error = None if None in errors else round(math.sqrt(sum(e * e for e in errors)) / len(errors), 2)
        rows.append(row(tables.AVERAGE, run.average, averaged, error))
    return rows


def _dataset_order(benchmark: Benchmark, name: str) -> tuple:
    """Subfolders (RULER's lengths) numerically, then the benchmark's own dataset order."""
    *folders, base = name.split("/")
    known = benchmark.datasets.index(base) if base in benchmark.datasets else len(benchmark.datasets)
    return tuple(int(part) if part.isdigit() else part for part in folders), known, name


# --------------------------------------------------------------------------- tables


def mark(value: float | None, incomplete: bool) -> float | str | None:
    """A table cell: ``value``, with ``*`` when it stands on fewer samples than expected."""
    if not incomplete:
        return value
    return ("-" if value is None or math.isnan(value) else f"{value:.2f}") + INCOMPLETE


def marked(value: float | None, scores: Iterable[DatasetScore]) -> float | str | None:
    """``mark`` for a cell that stands on ``scores``."""
    return mark(value, any(score.complete is False for score in scores))


def samples_cell(scores: Iterable[DatasetScore]) -> str:
    """``scored/expected`` over ``scores`` (``?`` where no runner recorded what to expect)."""
    scores = list(scores)
    expected = [score.expected for score in scores]
    total = "?" if None in expected else str(sum(expected))
    return f"{sum(score.scored for score in scores)}/{total}"


def footnotes(label: str, scores: Mapping[str, DatasetScore]) -> list[str]:
    """One line per incomplete dataset (``* run / dataset: 3/6 samples``) and per dataset with
    samples answered with the full cache."""
    lines = []
    for name, score in scores.items():
        if score.complete is False:
            lines.append(f"{INCOMPLETE} {label} / {name}: {score.scored}/{score.expected} samples")
        if score.uncompressed:
            lines.append(f"  {label} / {name}: {score.uncompressed} of {score.scored} samples answered with the "
                         "full cache (prompt too short for the ratio budget)")
    return lines


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], first: str = "run") -> str:
    """A plain-text table; numbers with 2 decimals, missing or NaN cells as '-'."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    header = [first, *columns]
    body = [[cell(row.get(name)) for name in header] for row in rows]
    widths = [max(len(str(h)), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for line in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(lines)


def runs_table(runs: Sequence[RunScores], columns: Sequence[str] | None = None, average: str = "average") -> str:
    """Runs × datasets, the average and the samples scored, incomplete cells marked, footnotes below."""
    if columns is None:
        columns = list(dict.fromkeys(name for run in runs for name in run.datasets))
    rows = []
    for run in runs:
        row: dict[str, Any] = {"run": run.label}
        for name in columns:
            if name in run.datasets:
                row[name] = marked(run.datasets[name].score, [run.datasets[name]])
        row[average] = marked(run.average, run.datasets.values())
        row["samples"] = samples_cell(run.datasets.values())
        rows.append(row)
    notes = [line for run in runs for line in footnotes(run.label, run.datasets)]
    return "\n".join([format_table(rows, [*columns, average, "samples"]), *notes])
