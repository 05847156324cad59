"""Score InfiniteBench predictions with the official per-task metrics.

    python eval_infinite.py --results_dir results/infinite_bench/MODEL/restkv_1024

``--results_dir`` is a run folder of ``run_infinite_bench.py`` (``<task>.jsonl`` files, shards
merged) or any folder above several of them. Each run gets ``infinite_scores.json``
({task: score, "Avg": mean}) and ``infinite_scores.csv``; one table row per run is printed.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Sequence

from restkv.benchmarks import infinitebench
from restkv.benchmarks.runner import datasets_in, format_table, read_predictions


def find_runs(results_dir: Path) -> list[Path]:
    """Folders (``results_dir`` or below it) holding prediction files of InfiniteBench tasks."""
    if not results_dir.is_dir():
        raise FileNotFoundError(f"--results_dir {results_dir} is not a folder")
    runs = sorted({p.parent for p in results_dir.glob("**/*.jsonl")
                   if p.name.split(".")[0] in infinitebench.TASKS})
    if not runs:
        raise FileNotFoundError(f"no InfiniteBench predictions (<task>.jsonl) under {results_dir}")
    return runs


def score_run(run_dir: Path) -> dict[str, float]:
    """{task: score} for every task file in ``run_dir``, in the official task order, plus ``Avg``."""
    present = set(datasets_in(run_dir))
    scores = {}
    for task in (t for t in infinitebench.TASKS if t in present):
        records = read_predictions(run_dir, task)
        for number, record in enumerate(records, 1):
            if "pred" not in record or "ground_truth" not in record:
                raise ValueError(f"{run_dir / task}.jsonl record {number}: needs 'pred' and 'ground_truth'")
        scores[task] = infinitebench.score_task(task, [r["pred"] for r in records],
                                                [r["ground_truth"] for r in records])
    if scores:
        scores["Avg"] = round(sum(scores.values()) / len(scores), 2)
    return scores


def main(argv: Sequence[str] | None = None) -> dict[Path, dict[str, float]]:
    parser = argparse.ArgumentParser(description="Score InfiniteBench predictions (official metrics).")
    parser.add_argument("--results_dir", required=True, help="a run_infinite_bench.py run folder, or a folder above")
    args = parser.parse_args(argv)
    root = Path(args.results_dir)
    results = {}
    for run_dir in find_runs(root):
        scores = score_run(run_dir)
        (run_dir / "infinite_scores.json").write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
        with open(run_dir / "infinite_scores.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(scores))
            writer.writeheader()
            writer.writerow(scores)
        results[run_dir] = scores
    columns = [t for t in [*infinitebench.TASKS, "Avg"] if any(t in s for s in results.values())]
    rows = [{"run": str(run.relative_to(root)) if run != root else run.name, **s} for run, s in results.items()]
    print(format_table(rows, columns))
    return results


if __name__ == "__main__":
    main()
