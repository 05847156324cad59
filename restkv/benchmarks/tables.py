"""Results as one table and one figure: every sweep and evaluator writes its scores as rows of one
layout, a combined CSV and a strict JSON beside it, and draws score against the share of the
cache kept.

A row is one task of one run (``task`` ``average`` for the run's mean)::

    {"benchmark": "ruler", "model": "smollm2-135m", "setting": "query-agnostic", "method": "snapkv",
     "options": "residual", "budget": null, "compression_ratio": 0.9, "kv_kept": 0.11,
     "task": "2048/niah_single_1", "score": 75.0, "n": 4, "expected": 4, "stderr": 25.0,
     "uncompressed": 0, "run": "results/sweep/smollm2-135m/snapkv_ratio0.9_residual_agnostic"}

``budget`` is tokens per layer and KV head (``--max_capacity_prompts``), ``compression_ratio``
the share of the prompt removed (null where the run has the other, both null for the full
cache); ``kv_kept`` is the share of the prompt's tokens the cache held (the runs' own cache
reports); ``n`` samples scored of ``expected``; ``stderr`` the standard error of the mean of
the per-sample scores. Numbers are numbers (never strings), NaN is written as null, and the
JSON is strict (``allow_nan=False``), so every JSON parser reads it.

**Merging, never overwriting.** ``write_table`` merges the new rows into the table already at
its path, by ``KEY``: a row replaces the one it matches unless that one stands on more
samples (a partial rerun, one shard, cannot shrink a fuller table), and rows the new run did
not produce are kept.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from restkv.benchmarks.errors import DataError

COLUMNS = ("benchmark", "model", "setting", "method", "options", "budget", "compression_ratio", "kv_kept", "task",
           "score", "n", "expected", "stderr", "uncompressed", "run")
#: what makes two rows the same measurement (a newer one replaces an older one)
KEY = ("benchmark", "model", "setting", "method", "options", "budget", "compression_ratio", "task")
NUMERIC = ("budget", "compression_ratio", "kv_kept", "score", "n", "expected", "stderr", "uncompressed")
AVERAGE = "average"
QUERY_AWARE, QUERY_AGNOSTIC = "query-aware", "query-agnostic"
#: the JSON file's own name for its layout, so a file of another layout is never merged into
FORMAT = "restkv-results-table/1"


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (in lists and dicts too) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def strict_json(data: Any, indent: int | None = 2) -> str:
    """JSON that every parser reads: NaN and infinities as null (``allow_nan=False`` checks it)."""
    return json.dumps(finite(data), indent=indent, ensure_ascii=False, allow_nan=False)


def label(row: Mapping[str, Any]) -> str:
    """A row's method as the sweep names it: ``snapkv+residual``."""
    return "+".join(part for part in (row["method"], row.get("options")) if part)


def budget_label(row: Mapping[str, Any]) -> str:
    """``full``, a token budget, or the share kept under a ratio budget (``0.9`` -> ``10%``)."""
    if row.get("compression_ratio") is not None:
        return f"{round(100 * (1 - row['compression_ratio']))}%"
    return "full" if row.get("budget") is None else str(row["budget"])


def stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean of ``values`` (None under two values)."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    variance = sum((value - mean) ** 2 for value in values) / (len(values) - 1)
    return round(math.sqrt(variance / len(values)), 2)


def row_key(row: Mapping[str, Any]) -> tuple:
    return tuple(row.get(name) for name in KEY)


def merge_rows(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with ``new`` merged in by ``KEY``: a new row replaces an old one unless the old one
    scored more samples; old rows without a new one stay; order: old rows, then new keys."""
    merged = {row_key(row): dict(row) for row in old}
    for row in new:
        previous = merged.get(row_key(row))
        if previous is None or (row.get("n") or 0) >= (previous.get("n") or 0):
            merged[row_key(row)] = dict(row)
    return list(merged.values())


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a table's JSON (none when there is no file); raises ``DataError`` for a file
    of another layout (an older sweep's JSON), which ``write_table`` would otherwise drop."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}: not valid JSON ({error}); move it away to write a new table there") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{path}: not a results table of this version (no \"format\": {FORMAT!r}); "
                        "move it away to write a new table there")
    return data["rows"]


def table_file(stem: str | Path, suffix: str) -> Path:
    """``<stem><suffix>`` (a stem may hold dots: ``sweep_0.9``)."""
    stem = Path(stem)
    return stem.with_name(stem.name + suffix)


def write_table(rows: Iterable[Mapping[str, Any]], stem: str | Path) -> tuple[list[dict[str, Any]], Path, Path]:
    """Merge ``rows`` into the table at ``<stem>.json`` (``merge_rows``) and write it there and as
    ``<stem>.csv`` (one line per row, ``COLUMNS``, empty cells for null). Returns the merged rows
    and both paths."""
    json_path, csv_path = table_file(stem, ".json"), table_file(stem, ".csv")
    merged = [{name: finite(row.get(name)) for name in COLUMNS}
              for row in merge_rows(read_rows(json_path), rows)]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(strict_json({"format": FORMAT, "columns": list(COLUMNS), "rows": merged}) + "\n",
                         encoding="utf-8")
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows({name: "" if value is None else value for name, value in row.items()} for row in merged)
    return merged, json_path, csv_path


#: distinct per method, so that methods with equal scores stay visible on one another
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")


def score_figure(rows: Iterable[Mapping[str, Any]], out_path: str | Path, title: str = ""):
    """Score against the share of the cache kept: one panel per benchmark and setting, one series
    per method (``label``) of its ``average`` rows, a distinct marker each, error bars from
    ``stderr``; the full cache is also a dashed line across its panel. Rows without ``kv_kept``
    (files no runner wrote) are left out; raises ``ValueError`` when none is left. Saves a PNG
    and returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    drawn = [row for row in rows if row["task"] == AVERAGE and row.get("kv_kept") is not None
             and row.get("score") is not None]
    if not drawn:
        raise ValueError("no averaged scores with the share of the cache kept to plot")
    panels = list(dict.fromkeys((row["benchmark"], row.get("setting")) for row in drawn))
    methods = list(dict.fromkeys(label(row) for row in drawn))
    figure, axes_list = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False, sharey=True)
    for axes, (benchmark, setting) in zip(axes_list[0], panels):
        in_panel = [row for row in drawn if (row["benchmark"], row.get("setting")) == (benchmark, setting)]
        for index, method in enumerate(methods):
            points = sorted((row for row in in_panel if label(row) == method), key=lambda row: row["kv_kept"])
            if not points:
                continue
            errors = [row.get("stderr") or 0.0 for row in points]
            # hollow markers, each method's smaller than the one before: equal points show every method
            axes.errorbar([row["kv_kept"] for row in points], [row["score"] for row in points], yerr=errors,
                          marker=MARKERS[index % len(MARKERS)], markersize=max(4.0, 12 - 1.2 * index),
                          markerfacecolor="none", markeredgewidth=1.5, capsize=3, linestyle="-", linewidth=1,
                          label=method, color=f"C{index % 10}")
            if all(row.get("budget") is None and row.get("compression_ratio") is None for row in points):
                axes.axhline(points[0]["score"], linestyle="--", linewidth=0.8, color=f"C{index % 10}")
        axes.set_xlim(0, 1.05)
        axes.xaxis.set_major_formatter(PercentFormatter(xmax=1))
        axes.set_xlabel("share of the prompt's KV cache kept")
        axes.set_title(" ".join(part for part in (benchmark, setting) if part))
        axes.grid(alpha=0.3)
    axes_list[0][0].set_ylabel("score (mean over tasks, ± stderr)")
    axes_list[0][-1].legend(fontsize=8, loc="best")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return figure


def write_results(rows: Iterable[Mapping[str, Any]], stem: str | Path, title: str = "") -> dict[str, Path]:
    """``write_table``, then the figure of the merged table as ``<stem>.png`` (none when no row
    says what the cache kept). Returns the paths written ({"json", "csv"[, "png"]})."""
    merged, json_path, csv_path = write_table(rows, stem)
    written = {"json": json_path, "csv": csv_path}
    png_path = table_file(stem, ".png")
    try:
        score_figure(merged, png_path, title)
    except ValueError:
        return written
    written["png"] = png_path
    return written
