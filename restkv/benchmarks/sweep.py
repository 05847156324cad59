"""A budget sweep on needle-style RULER tasks, printed as one comparison table.

    python -m restkv.benchmarks.sweep           # smollm2-135m, 2K-token niah tasks, 2 budgets
    python -m restkv.benchmarks.sweep --length 4096 --compression_ratios 0.9 0.8 --num_samples 20 \
        --methods streamingllm snapkv h2o restkv snapkv+residual --query_agnostic
    python -m restkv.benchmarks.sweep --compression_ratios 0.9 --methods snapkv kvzip \
        snapkv+observation=reconstruction --multi_question

A method may carry boolean flags after ``+`` (``snapkv+residual`` runs ``--method snapkv
--residual``) and options as ``+NAME=VALUE`` (``snapkv+observation=reconstruction``).
``--multi_question`` asks about every needle of a context compressed once (niah tasks; a
task's score is then the mean over its questions, and ``samples`` counts questions).
``--num_shards/--shard_id`` split every run's samples over processes; rerun without them
(everything already written is skipped) to print the whole table.

The data come from the project's offline RULER generator (``restkv.benchmarks.ruler_data``),
the runs from the RULER runner (``restkv.benchmarks.ruler``: resumable, one folder per method
and budget under ``--save_dir``), the scores from RULER's metrics. The model is loaded once;
the full cache runs first, then every method at every budget. The table gives each task's
score, the average, the fraction of prompt tokens the cache kept (from the runs' own cache
reports, so a run in which nothing was compressed would show 1.00) and the samples scored of
those expected; a score that stands on fewer samples than expected (one shard of several, an
interrupted run) is marked ``*``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from restkv.benchmarks import ruler, ruler_data, scoring
from restkv.benchmarks.errors import command_line
from restkv.benchmarks.flags import ATTN_IMPLEMENTATIONS, check_minimums, parse_args as parse_runner_args
from restkv.benchmarks.results import named_in_folder, read_predictions
from restkv.config import ConfigError, method_spec_options

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_multikey_1"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.benchmarks.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048, help="RULER sequence length (prompt + answer tokens)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated RULER tasks")
    parser.add_argument("--num_samples", type=int, default=4, help="samples per task")
    parser.add_argument("--methods", nargs="+", default=["streamingllm", "snapkv", "h2o"])
    budgets = parser.add_mutually_exclusive_group()
    budgets.add_argument("--budgets", type=int, nargs="+", default=[256, 512],
                         help="max_capacity_prompts values (tokens per layer and KV head, window included)")
    budgets.add_argument("--compression_ratios", type=float, nargs="+",
                         help="fractions of each prompt removed, instead of --budgets")
    parser.add_argument("--query_agnostic", action="store_true", help="compress the context before the question")
    parser.add_argument("--multi_question", action="store_true",
                        help="compress each context once and ask about each of its needles (implies "
                        "--query_agnostic; niah tasks only)")
    parser.add_argument("--max_new_tokens", type=int, help="tokens generated per answer at most (default: each "
                        "task's RULER length)")
    parser.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS)
    parser.add_argument("--save_dir", default="results/sweep")
    parser.add_argument("--num_shards", type=int, default=1)
    parser.add_argument("--shard_id", type=int, default=0)
    return parser


def method_flags(spec: str) -> list[str]:
    """``snapkv+residual`` -> ``--method snapkv --residual``, ``snapkv+kernel_size=7`` ->
    ``--method snapkv --kernel_size 7 --tag kernel_size=7``: the tag holds the spec's parts that
    the run's folder name does not say (``results.named_in_folder``), so every variant's folder
    stays apart from the plain method's."""
    options = method_spec_options(spec)
    method = options.pop("method")
    flags = []
    for name, value in options.items():
        flags += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    unnamed = [part for part in spec.split("+")[1:] if not named_in_folder(part.partition("=")[0])]
    tag = ["--tag", "+".join(unnamed)] if unnamed else []
    return ["--method", method, *flags, *tag]


def budget_flags(args: argparse.Namespace) -> list[list[str]]:
    """One flag list per budget of the sweep."""
    if args.compression_ratios:
        return [["--compression_ratio", str(ratio)] for ratio in args.compression_ratios]
    return [["--max_capacity_prompts", str(budget)] for budget in args.budgets]


def budget_label(flags: list[str]) -> str:
    """``full``, a token budget, or the kept share of a ratio budget (``--compression_ratio 0.9`` -> 10%)."""
    if not flags:
        return "full"
    if flags[0] == "--compression_ratio":
        return f"{round(100 * (1 - float(flags[1])))}%"
    return flags[1]


def configurations(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(method spec, budget flags) of every run: the full cache first, then every method at every budget."""
    return [("fullkv", [])] + [(spec, budget) for budget in budget_flags(args) for spec in args.methods]


def runner_args(args: argparse.Namespace, spec: str, budget: list[str]) -> argparse.Namespace:
    """The RULER runner's flags of one configuration, checked (raises ``FlagError`` or ``ConfigError``)."""
    argv = [*method_flags(spec), *budget, "--model_path", args.model_path,
            "--data_dir", str(Path(args.save_dir) / "data"), "--context_lengths", str(args.length),
            "--datasets", ",".join(ruler.parse_task_list(args.tasks)),
            "--save_dir", str(args.save_dir), "--attn_implementation", args.attn_implementation,
            "--num_shards", str(args.num_shards), "--shard_id", str(args.shard_id),
            *(["--query_agnostic"] if args.query_agnostic else []),
            *(["--multi_question"] if args.multi_question else []),
            *(["--max_new_tokens", str(args.max_new_tokens)] if args.max_new_tokens is not None else [])]
    return parse_runner_args(ruler.BENCHMARK, argv, ruler.add_flags, raising=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The sweep's flags, with every configuration's runner flags checked before anything runs; a
    bad value prints the sweep's usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        tasks = ruler.parse_task_list(args.tasks)
        check_minimums(args, {"num_samples": 1})
        ruler_data.check_lengths(tasks, [args.length], flag="--length")
        for spec, budget in configurations(args):
            runner_args(args, spec, budget)
    except (ConfigError, ValueError) as error:  # FlagError and DataError are ValueErrors
        parser.error(str(error))
    return args


def run_sweep(args: argparse.Namespace, model=None, tokenizer=None) -> list[dict]:
    """Generate the data, run every configuration, return one table row per configuration."""
    from restkv.integrations.transformers.models import load_model, load_tokenizer

    tasks = ruler.parse_task_list(args.tasks)
    tokenizer = tokenizer or load_tokenizer(args.model_path)
    for task in tasks:
        ruler_data.write_task(Path(args.save_dir) / "data", task, args.length, args.num_samples, tokenizer,
                              args.model_path)
    model = model or load_model(args.model_path, attn_implementation=args.attn_implementation)
    rows = []
    for spec, budget in configurations(args):
        folder = ruler.run_args(runner_args(args, spec, budget), model=model, tokenizer=tokenizer)
        rows.append(summarise(folder, spec, budget_label(budget), tasks, args.length))
    return rows


def summarise(folder: Path, method: str, budget: str, tasks: list[str], length: int) -> dict:
    """One table row: scores per task, their average, the kept fraction of the cache, the samples
    scored, the tasks scored on fewer samples than expected, and the table's footnotes for them."""
    run = scoring.score_run(folder, ruler.BENCHMARK, label=f"{method} {budget}")
    scores = {task: run.datasets[f"{length}/{task}"] for task in tasks}
    row: dict = {"method": method, "budget": budget, **{task: score.score for task, score in scores.items()}}
    scored = [score.score for score in scores.values() if score.score is not None]
    row["avg"] = round(sum(scored) / len(scored), 2) if scored else None
    records = [record for task in tasks for record in read_predictions(folder / str(length), task)]
    seen = sum(record["kv_tokens_seen"] for record in records)
    row["kv kept"] = f"{sum(record['kv_tokens_stored'] for record in records) / seen:.2f}" if seen else None
    row["samples"] = scoring.samples_cell(scores.values())
    row["incomplete"] = [task for task, score in scores.items() if score.complete is False]
    row["notes"] = scoring.footnotes(run.label, scores)
    return row


def report(args: argparse.Namespace, rows: Sequence[dict]) -> str:
    """The sweep's table: a header line, one row per configuration, incomplete cells marked."""
    tasks = ruler.parse_task_list(args.tasks)
    mode = "query-agnostic, one question per needle" if args.multi_question else (
        "query-agnostic" if args.query_agnostic else "query-aware")
    shard = f" (shard {args.shard_id} of {args.num_shards})" if args.num_shards > 1 else ""
    shown = [{**row, **{task: scoring.mark(row[task], task in row["incomplete"]) for task in tasks},
              "avg": scoring.mark(row["avg"], bool(row["incomplete"]))} for row in rows]
    return "\n".join([
        f"RULER {args.length} tokens, {args.num_samples} samples per task{shard}, {args.model_path}, {mode}",
        scoring.format_table(shown, ["budget", *tasks, "avg", "kv kept", "samples"], first="method"),
        *(note for row in rows for note in row["notes"]),
    ])


@command_line
def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = run_sweep(args)
    print("\n" + report(args, rows))
    mode = "_agnostic_multi" if args.multi_question else "_agnostic" if args.query_agnostic else ""
    out = Path(args.save_dir) / f"sweep_{args.length}{mode}.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"(rows written to {out})")
    return rows


if __name__ == "__main__":
    main()
