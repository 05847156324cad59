"""Run LongBench with a compressed KV cache: one jsonl of predictions per dataset.

    python run_longbench.py --method snapkv --model_path smollm2-135m --max_capacity_prompts 128
    python run_longbench.py --method restkv --max_capacity_prompts 128 --datasets qasper hotpotqa --query_agnostic

Data: ``--data_dir`` (default data/LongBench) holds the official ``<dataset>.jsonl`` files.
Flags: ``python run_longbench.py --help``; output layout: restkv/benchmarks/results.py.
``--help`` lists the common flags and ``--method``'s options (``--help-all``: every flag);
``--config FILE`` reads flags from YAML or JSON (a results folder's ``run_meta.json`` re-runs it);
``--plugin PATH_OR_MODULE`` adds a method or other part from outside the package.
Score the predictions with ``python eval.py --results_dir <save_dir>/<model>``.
"""

from restkv.benchmarks.longbench import run

if __name__ == "__main__":
    run()
