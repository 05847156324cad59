"""InfiniteBench with a compressed KV cache.

    python run_infinite_bench.py --model_path PATH --method restkv --max_capacity_prompts 1024 \
        --data_dir data/InfiniteBench --datasets passkey,kv_retrieval,longbook_qa_eng
    python eval_infinite.py --results_dir results/infinite_bench/MODEL/restkv_1024

Data: ``<data_dir>/<task>.jsonl`` of the HF dataset ``xinrongzhang2022/InfiniteBench``. Prompts are
the official yarn-mistral templates without chat template (``--chat_template`` wraps them),
middle-truncated to ``--model_max_len``; each task generates its official number of tokens
(``--generation_lengths release``: the ReST-KV release's). Predictions, with the gold label
as ``ground_truth``, go to ``<save_dir>/<model>/<method>_<budget>/<task>.jsonl``. Common flags
(model, compression, sharding): ``restkv.benchmarks.flags``; resume: ``restkv.benchmarks.results``.
``--help`` lists the common flags and ``--method``'s options (``--help-all``: every flag);
``--config FILE`` reads flags from YAML or JSON (a results folder's ``run_meta.json`` re-runs it);
``--plugin PATH_OR_MODULE`` adds a method or other part from outside the package.
"""

from restkv.benchmarks.infinitebench import run

if __name__ == "__main__":
    run()
