"""Figures from result files: needle heatmap, budget-vs-score curves, efficiency, attention maps.

Every function takes plain rows (read from the files the runners and evals write), draws
with matplotlib's Agg backend (no display, no notebook), saves a PNG and returns the
Figure so callers and tests can inspect what was drawn. No number is hard-coded here.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import matplotlib
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402

from restkv.benchmarks.needle import score_grid  # noqa: E402
from restkv.benchmarks.tables import MARKERS  # noqa: E402

matplotlib.use("Agg")


# gkamradt's needle colours: red (miss) -> yellow -> green (found).
NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])


def _save(figure, out_path: str | Path):
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=120, bbox_inches="tight")
    return figure


def needle_heatmap(rows: Iterable[Mapping], out_path: str | Path, title: str = "",
                   pretrained_length: int | None = None):
    """Mean score per (depth, context length): rows = depth %, columns = token limit, 0..1.

    ``rows`` are ``needle_results.json`` cells (``context_length``, ``depth_percent``,
    ``score``). Cells without a result are left blank; a dashed line marks
    ``pretrained_length`` when it falls inside the grid.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("no needle results to plot")
    depths, lengths, grid = score_grid(rows)
    values = np.array([[np.nan if v is None else v for v in line] for line in grid], dtype=float)
    mean = float(np.mean([row["score"] for row in rows]))
    figure, axes = plt.subplots(figsize=(max(6.0, 0.45 * len(lengths) + 2), max(3.5, 0.4 * len(depths) + 1.5)))
    image = axes.imshow(values, cmap=NEEDLE_CMAP, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    axes.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45, ha="right")
    axes.set_yticks(range(len(depths)), [str(d) for d in depths])
    axes.set_xlabel("Token Limit")
    axes.set_ylabel("Depth Percent")
    axes.set_title(f"{title} average score={mean:.2f}".strip())
    if pretrained_length is not None and lengths[0] <= pretrained_length < lengths[-1]:
        position = int(np.searchsorted(lengths, pretrained_length, side="right")) - 0.5
        axes.axvline(position, color="white", linestyle="--", linewidth=2)
    figure.colorbar(image, ax=axes, fraction=0.03, label="score")
    return _save(figure, out_path)


def read_run_scores(results_root: str | Path) -> list[dict]:
    """One row ``{benchmark, method, budget, score, run}`` per run folder under ``results_root``
    (``method``: the method and what its folder name says of the run besides the budget).

    A run folder has the runner's ``run_meta.json`` (method and budget) and a score file of
    an eval: ``metrics.json`` (LongBench average), ``ruler_scores.json`` (mean over lengths of
    the per-length task average), ``infinite_scores.json`` (``Avg``) or
    ``needle_results.json`` (mean score × 100). ``budget`` is None for the full cache; runs
    budgeted by ``--compression_ratio`` are left out.
    """
    rows = []
    for meta_path in sorted(Path(results_root).glob("**/run_meta.json")):
        folder = meta_path.parent
        config = json.loads(meta_path.read_text(encoding="utf-8"))["settings"]["config"]
        budget = config.get("max_capacity_prompts") if config["method"] != "fullkv" else None
        if budget is None and config["method"] != "fullkv":
            continue  # a --compression_ratio run has no place on a budget axis
        for benchmark, score in _scores_in(folder):
            rows.append({"benchmark": benchmark, "method": _variant_label(folder.name, config["method"], budget),
                         "budget": budget, "score": score, "run": str(folder)})
    return rows


def _variant_label(folder_name: str, method: str, budget: int | None) -> str:
    """A run's line in a budget plot: its folder's name without the budget
    (``snapkv_128_residual_agnostic`` -> ``snapkv_residual_agnostic``), so variants of a method
    (switches, modes, tags: what the runners name folders by) are not averaged into one line."""
    prefix = method if budget is None else f"{method}_{budget}"
    if folder_name == prefix or folder_name.startswith(prefix + "_"):
        return method + folder_name[len(prefix):]
    return folder_name


def _scores_in(folder: Path) -> list[tuple[str, float]]:
    found = []
    if (path := folder / "metrics.json").is_file():
        found.append(("LongBench", json.loads(path.read_text())["average"]))
    if (path := folder / "ruler_scores.json").is_file():
        per_length = json.loads(path.read_text()).values()
        averages = [sum(tasks.values()) / len(tasks) for tasks in per_length if tasks]
        found.append(("RULER", sum(averages) / len(averages)))
    if (path := folder / "infinite_scores.json").is_file():
        found.append(("InfiniteBench", json.loads(path.read_text())["Avg"]))
    if (path := folder / "needle_results.json").is_file():
        found.append(("Needle", 100 * json.loads(path.read_text())["mean_score"]))
    return [(name, float(score)) for name, score in found if score is not None and not math.isnan(score)]


def budget_curves(rows: Iterable[Mapping], out_path: str | Path, title: str = ""):
    """Score vs KV budget, one line per method and one panel per benchmark (log2 budget axis).

    Rows without a budget (the full cache) are drawn as a dashed horizontal reference.
    """
    by_benchmark: dict[str, list[Mapping]] = defaultdict(list)
    for row in rows:
        by_benchmark[row["benchmark"]].append(row)
    if not by_benchmark:
        raise ValueError("no scores to plot (need run folders with run_meta.json and an eval's score file)")
    names = sorted(by_benchmark)
    figure, axes_list = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for axes, name in zip(axes_list[0], names):
        methods: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        references: dict[str, list[float]] = defaultdict(list)
        for row in by_benchmark[name]:
            if row["budget"] is None:
                references[row["method"]].append(row["score"])
            else:
                methods[row["method"]][int(row["budget"])].append(row["score"])
        for index, method in enumerate(sorted(methods)):  # a marker each: equal scores do not hide a method
            budgets = sorted(methods[method])
            axes.plot(budgets, [np.mean(methods[method][b]) for b in budgets], label=method, alpha=0.85,
                      marker=MARKERS[index % len(MARKERS)])
        for method, scores in sorted(references.items()):
            axes.axhline(float(np.mean(scores)), linestyle="--", color="grey", label=method)
        if methods:
            axes.set_xscale("log", base=2)
            all_budgets = sorted({b for per_method in methods.values() for b in per_method})
            axes.set_xticks(all_budgets, [str(b) for b in all_budgets])
        axes.set_xlabel("KV budget (tokens per layer and KV head)")
        axes.set_ylabel("score")
        axes.set_title(name)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return _save(figure, out_path)


EFFICIENCY_PANELS = (
    ("prefill_s", "prefill (s)", 1.0),
    ("decode_s_per_token", "decode (ms / token)", 1000.0),
    ("cache_bytes", "KV cache (MiB)", 1 / 2**20),
)
#: drawn when every row has it (``scripts/efficiency.py --peak_memory``)
PEAK_PANEL = ("peak_above_ready_bytes", "peak memory above the model (MiB)", 1 / 2**20)


def efficiency_plot(rows: Iterable[Mapping], out_path: str | Path, title: str = ""):
    """Prefill time, decode time per token and cache size vs prompt length, a line per method.

    ``rows`` are ``results/efficiency.json`` rows ``{method, prompt_tokens, prefill_s,
    decode_s_per_token, cache_bytes}`` (``budget`` optional: a method run at several budgets
    gets a line per budget); rows of ``--peak_memory`` add a peak-memory panel. Repeated rows
    of one point are averaged.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("no efficiency rows to plot")
    budgets_per_method = defaultdict(set)
    for row in rows:
        budgets_per_method[row["method"]].add(row.get("budget"))
    series: dict[str, dict[int, list[Mapping]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        label = row["method"]
        if len(budgets_per_method[label]) > 1:
            label = f"{label} ({row.get('budget')})"
        series[label][int(row["prompt_tokens"])].append(row)
    panels = EFFICIENCY_PANELS + ((PEAK_PANEL,) if all(PEAK_PANEL[0] in row for row in rows) else ())
    figure, axes_list = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for axes, (key, label, scale) in zip(axes_list, panels):
        for name in sorted(series):
            lengths = sorted(series[name])
            values = [scale * float(np.mean([r[key] for r in series[name][n]])) for n in lengths]
            axes.plot(lengths, values, marker="o", label=name)
        axes.set_xlabel("prompt tokens")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
    axes_list[0].legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return _save(figure, out_path)


def attention_maps(before: np.ndarray, after: np.ndarray, kept: Sequence[int], out_path: str | Path,
                   title: str = "", marks: Mapping[str, int] | None = None, first_query: int = 0):
    """Two heatmaps of one head's attention (queries × keys): full cache, and the kept keys only.

    ``before``/``after`` are ``[queries, keys]`` probabilities (``after`` zero on evicted keys)
    for the queries at positions ``first_query, first_query + 1, ...``. Colours are log10 so
    that small weights stay visible; ``kept`` positions are ticked under the second map and
    ``marks`` ({label: key position}, e.g. the needle) are drawn as dotted lines.
    """
    floor = 1e-6
    queries, keys = before.shape
    extent = (-0.5, keys - 0.5, first_query + queries - 0.5, first_query - 0.5)
    figure, axes_list = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for axes, matrix, name in zip(axes_list, (before, after), ("full cache", f"after compression ({len(kept)} kept)")):
        image = axes.imshow(np.log10(np.maximum(matrix, floor)), cmap="viridis", vmin=math.log10(floor), vmax=0,
                            aspect="auto", interpolation="nearest", extent=extent)
        axes.set_title(name)
        axes.set_xlabel("key position")
        for label, position in (marks or {}).items():
            axes.axvline(position, color="red", linewidth=0.8, linestyle=":")
            axes.text(position + 1, first_query + 0.02 * queries, label, color="red", fontsize=8, ha="left", va="top")
    axes_list[0].set_ylabel("query position")
    axes_list[1].plot(kept, [first_query + queries - 0.5] * len(kept), "|", color="white", markersize=6)
    figure.colorbar(image, ax=axes_list, fraction=0.025, label="log10 attention")
    if title:
        figure.suptitle(title)
    return _save(figure, out_path)
