"""Score LongBench predictions with the official metrics: per-dataset scores, average, length buckets.

    python eval.py --results_dir results/longbench/smollm2-135m

``--results_dir`` is one run folder (``<method>_<budget>``) or a folder above several; each
run gets a row. Writes ``metrics.json`` and ``scores.json`` (every benchmark's common layout:
samples scored and expected per dataset) in every run folder, and ``results.json`` and
``results.csv`` in ``--results_dir``, and every run as one table in ``score_table.csv`` and
``score_table.json`` (one row per run and dataset: method, options, budget, share of the cache
kept, score, samples, stderr; numbers as numbers, strict JSON) with its figure
``score_table.png`` (``restkv.benchmarks.tables``); a score on fewer samples than the run
expects is marked ``*``. Official-format prediction files (``pred``, ``answers``, ``all_classes``, ``length`` per
line) are scored the same way.
"""

from restkv.benchmarks.longbench import evaluate

if __name__ == "__main__":
    evaluate()
