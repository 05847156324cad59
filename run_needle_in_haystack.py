"""Needle-in-a-Haystack with a compressed KV cache.

    python run_needle_in_haystack.py --model_path smollm2-135m --method snapkv --max_capacity_prompts 128 \
        --s_len 1000 --e_len 8000 --step 1000
    python visualization/visualize.py needle --results results/needle/smollm2-135m/snapkv_128/needle_results.json

Each (context length, depth) cell is one sample (see ``restkv.benchmarks.needle`` for the
protocol and the scorer). Predictions go to ``<save_dir>/<model>/<method>_<budget>/needle.jsonl``
(resumable, shardable: ``restkv.benchmarks.runner``); at the end every cell written so far is
scored into ``needle_results.json`` beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from restkv.benchmarks import needle
from restkv.benchmarks.haystack import ESSAY_DIR, load_essays
from restkv.benchmarks.runner import Benchmark, BenchmarkRun, Sample, parse_args, read_predictions
from restkv.models import load_tokenizer


def needle_samples(args: argparse.Namespace, tokenizer) -> list[Sample]:
    lengths = args.context_lengths or needle.context_lengths(args.s_len, args.e_len, args.step)
    depths = needle.depth_percents(args.depth_intervals)
    haystack = load_essays(args.data_dir, min_words=max(lengths))
    prompts = needle.build_prompts(tokenizer, haystack, lengths, depths, buffer=args.final_context_length_buffer,
                                   chat=args.chat_template)
    return [
        Sample(
            id=f"len_{p.context_length}_depth_{p.depth_percent}",
            context=p.context,
            question=p.question,
            max_new_tokens=needle.MAX_NEW_TOKENS,
            fields={"context_length": p.context_length, "depth_percent": p.depth_percent, "haystack": haystack.source},
            chat=args.chat_template,
            stop_tokens=("\n",),
        )
        for p in prompts
    ]


BENCHMARK = Benchmark(
    "needle",
    datasets=("needle",),
    default_datasets=("needle",),
    load_samples=lambda args, dataset: needle_samples(args, load_tokenizer(args.model_path)),
    default_data_dir=str(ESSAY_DIR),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("needle")
    group.add_argument("--s_len", type=int, default=1000, help="smallest context length (tokens)")
    group.add_argument("--e_len", type=int, default=8000, help="largest context length (tokens, inclusive)")
    group.add_argument("--step", type=int, default=1000, help="context length step")
    group.add_argument("--context_lengths", type=int, nargs="+", default=None,
                       help="explicit lengths (instead of s/e/step)")
    group.add_argument("--depth_intervals", type=int, default=10, help="number of depths from 0 to 100 percent")
    group.add_argument("--final_context_length_buffer", type=int, default=needle.CONTEXT_BUFFER,
                       help="tokens of each length left for the prompt wrapper and the answer")
    group.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=True,
                       help="wrap the prompt in the tokenizer's chat template; --no-chat_template sends the "
                       "release's raw prompt")
    # The original release's needle runner spelled these differently from the other runners.
    group.add_argument("--haystack_dir", dest="data_dir", default=argparse.SUPPRESS,
                       help="alias of --data_dir: folder of *.txt essays; the project's synthetic prose if absent")
    group.add_argument("--model_name", dest="model_path", default=argparse.SUPPRESS, help="alias of --model_path")
    group.add_argument("--max_capacity_prompt", dest="max_capacity_prompts", type=int, default=argparse.SUPPRESS,
                       help="alias of --max_capacity_prompts")


def main(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    args = parse_args(BENCHMARK, argv, add_flags)
    session = BenchmarkRun.start(BENCHMARK, args, model=model, tokenizer=tokenizer)
    session.run_dataset("needle", needle_samples(args, session.tokenizer))
    rows = needle.score_records(read_predictions(session.folder, "needle"))
    results = needle.write_results(rows, session.folder / "needle_results.json", model=args.model_path,
                                   method=session.config.method, budget=session.config.max_capacity_prompts)
    print(f"predictions in {session.folder}; mean score {results['mean_score']:.3f} over {len(rows)} cells")
    return session.folder


if __name__ == "__main__":
    main()
