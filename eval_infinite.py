"""Score InfiniteBench predictions with the official per-task metrics.

    python eval_infinite.py --results_dir results/infinite_bench/MODEL/restkv_1024

``--results_dir`` is a run folder of ``run_infinite_bench.py`` (``<task>.jsonl`` files, shards
merged) or any folder above several of them. Each run gets ``infinite_scores.json``
({task: score, "Avg": mean}), ``infinite_scores.csv`` and ``scores.json`` (samples scored and
expected per task); one table row per run is printed, a score on fewer samples than the run
expects marked ``*``. All runs together go to ``--results_dir``'s ``score_table.csv`` /
``.json`` and ``score_table.png`` (``restkv.benchmarks.tables``), merged into what an earlier
evaluation wrote.
"""

from restkv.benchmarks.infinitebench import evaluate

if __name__ == "__main__":
    evaluate()
