"""Run RULER with a compressed KV cache.

    python -m restkv.benchmarks.ruler_data --tokenizer smollm2-135m --lengths 4096 --num_samples 50
    python run_ruler.py --model_path smollm2-135m --method snapkv --max_capacity_prompts 128 \
        --data_dir data/RULER --context_lengths 4096 8192 --datasets niah_single_1,vt
    python eval_ruler.py --results_dir results/ruler/smollm2-135m/snapkv_128

Data: RULER's ``<data_dir>/<length>/<task>/validation.jsonl`` (from RULER's prepare.py or
``restkv.benchmarks.ruler_data``) or the ReST-KV release's ``<data_dir>/<length>/<task>.jsonl``.
The prompt is ``input`` in the tokenizer's chat template (``--no-chat_template``: raw), then
``answer_prefix``; each task generates RULER's official number of tokens (``--max_new_tokens``
overrides it; the ReST-KV release used 64 everywhere). Samples are built to fit their length,
so prompts are not truncated unless ``--model_max_len`` asks for it. Predictions go to
``<save_dir>/<model>/<method>_<budget>/<length>/<task>.jsonl`` with the gold ``outputs``.
``--multi_question`` (niah tasks) compresses each context once and asks about every needle
in it, one line per needle (``<method>_<budget>_agnostic_multi``).
Common flags (model, compression, sharding): ``restkv.benchmarks.flags``; resume:
``restkv.benchmarks.results``.
``--help`` lists the common flags and ``--method``'s options (``--help-all``: every flag);
``--config FILE`` reads flags from YAML or JSON (a results folder's ``run_meta.json`` re-runs it);
``--plugin PATH_OR_MODULE`` adds a method or other part from outside the package.
"""

from restkv.benchmarks.ruler import run

if __name__ == "__main__":
    run()
