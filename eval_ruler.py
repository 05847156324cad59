"""Score RULER predictions with RULER's metrics.

    python eval_ruler.py --results_dir results/ruler/smollm2-135m/snapkv_128

``--results_dir`` is a run folder of ``run_ruler.py`` (``<length>/<task>.jsonl`` files, shards
merged) or any folder above several of them; each run gets ``ruler_scores.json``
({length: {task: score}}), ``ruler_scores.csv`` (tasks by length, with averages) and
``scores.json`` (samples scored and expected per task), and its table is printed, a score on
fewer samples than the run expects marked ``*``. All runs together go to ``--results_dir``'s
``score_table.csv`` / ``.json`` (one numeric row per run and task: method, options, budget,
share of the cache kept, score, samples, stderr) and ``score_table.png`` (score against share
kept, a marker per method, error bars), merged into what an earlier evaluation wrote.
Predictions are post-processed as RULER does
(strip, control characters to newlines); niah/vt/cwe/fwe use string_match_all and qa
string_match_part.
"""

from restkv.benchmarks.ruler import evaluate

if __name__ == "__main__":
    evaluate()
