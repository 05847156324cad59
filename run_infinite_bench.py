"""InfiniteBench with a compressed KV cache.

    python run_infinite_bench.py --model_path PATH --method restkv --max_capacity_prompts 1024 \
        --data_dir data/InfiniteBench --datasets passkey,kv_retrieval,longbook_qa_eng
    python eval_infinite.py --results_dir results/infinite_bench/MODEL/restkv_1024

Data: ``<data_dir>/<task>.jsonl`` of the HF dataset ``xinrongzhang2022/InfiniteBench``. Prompts are
the official yarn-mistral templates without chat template (``--chat_template`` wraps them),
middle-truncated to ``--model_max_len``; each task generates its official number of tokens
(``--generation_lengths release``: the ReST-KV release's). Predictions, with the gold label
as ``ground_truth``, go to ``<save_dir>/<model>/<method>_<budget>/<task>.jsonl``. Common flags
(model, compression, sharding, resume): ``restkv.benchmarks.runner``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from restkv.benchmarks import infinitebench
from restkv.benchmarks.runner import Benchmark, DataError, Sample
from restkv.benchmarks.runner import main as run_main


def infinite_samples(args: argparse.Namespace, task: str) -> list[Sample]:
    try:
        examples = infinitebench.load_task(args.data_dir, task)
    except (ValueError, FileNotFoundError) as error:
        raise DataError(str(error)) from None
    spec = infinitebench.get_task(task)
    max_new_tokens = spec.release_max_new_tokens if args.generation_lengths == "release" else spec.max_new_tokens
    samples = []
    for position, example in enumerate(examples):
        context, question = infinitebench.build_prompt(example, task)
        samples.append(
            Sample(
                id=str(example.get("id", position)),
                context=context,
                question=question,
                max_new_tokens=max_new_tokens,
                fields={"ground_truth": infinitebench.get_answer(example, task), "dataset": task},
                chat=args.chat_template,
            )
        )
    return samples


BENCHMARK = Benchmark(
    "infinite_bench",
    datasets=tuple(infinitebench.TASKS),
    default_datasets=tuple(infinitebench.TASKS),
    load_samples=infinite_samples,
    default_data_dir="data/InfiniteBench",
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("infinite_bench")
    group.add_argument("--generation_lengths", choices=["official", "release"], default="official",
                       help="new tokens per task: InfiniteBench's, or the ReST-KV release's (passkey 15, "
                       "number_string 20, kv_retrieval 80)")
    group.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=False,
                       help="wrap prompts in the tokenizer's chat template (official and release: no)")


def main(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    return run_main(BENCHMARK, argv, add_flags, model=model, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
