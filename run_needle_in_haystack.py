"""Needle-in-a-Haystack with a compressed KV cache.

    python run_needle_in_haystack.py --model_path smollm2-135m --method snapkv --max_capacity_prompts 128 \
        --s_len 1000 --e_len 8000 --step 1000
    python visualization/visualize.py needle --results results/needle/smollm2-135m/snapkv_128/needle_results.json

Each (context length, depth) cell is one sample (see ``restkv.benchmarks.needle`` for the
protocol and the scorer). Predictions go to ``<save_dir>/<model>/<method>_<budget>/needle.jsonl``
(resumable, shardable: ``restkv.benchmarks.results``); at the end every cell written so far is
scored into ``needle_results.json`` beside them.
``--help`` lists the common flags and ``--method``'s options (``--help-all``: every flag);
``--config FILE`` reads flags from YAML or JSON (a results folder's ``run_meta.json`` re-runs it);
``--plugin PATH_OR_MODULE`` adds a method or other part from outside the package.
"""

from restkv.benchmarks.needle import run

if __name__ == "__main__":
    run()
