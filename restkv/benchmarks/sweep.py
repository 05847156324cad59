"""A budget sweep on needle-style RULER tasks: one comparison table, its CSV and JSON, and a figure.

    python -m restkv.benchmarks.sweep           # the README's first table (see below)
    python -m restkv.benchmarks.sweep --length 4096 --compression_ratios 0.9 0.8 --num_samples 20 \
        --methods streamingllm snapkv h2o restkv snapkv+residual --query_agnostic
    python -m restkv.benchmarks.sweep --compression_ratios 0.9 --methods snapkv kvzip \
        snapkv+observation=reconstruction --multi_question

By default it compares the full cache, StreamingLLM, SnapKV, ReST-KV, ReST-KV's preset for a context
compressed before its question (restkv_recon: the model's repetition of the context scores it), KVzip
and learned_zip (the cheap query-agnostic method: KVzip's ranking predicted from each key and value,
no second pass) at 10% and 20% of the prompt kept (``--compression_ratios 0.9 0.8``) on 4 samples of three
1024-token needle tasks of the embedded smollm2-135m (answers cut at 32 tokens: a method that
lost the needle would otherwise ramble on for RULER's 128), in both settings: query-aware (the
question inside the compressed prompt) and query-agnostic (the context compressed before the
question is seen: ``--query_agnostic`` runs only this one, ``--query_aware`` only the other).

A method may carry boolean flags after ``+`` (``snapkv+residual`` runs ``--method snapkv
--residual``) and options as ``+NAME=VALUE`` (``snapkv+observation=reconstruction``).
``--multi_question`` asks about every needle of a context compressed once (niah tasks; a
task's score is then the mean over its questions, and ``samples`` counts questions).
``--num_shards/--shard_id`` split every run's samples over processes; rerun without them
(everything already written is skipped) to print the whole table.

The data come from the project's offline RULER generator (``restkv.benchmarks.ruler_data``),
the runs from the RULER runner (``restkv.benchmarks.ruler``: resumable, one folder per method,
budget and setting under ``<save_dir>/len<length>``), the scores from RULER's metrics. The model is loaded
once; per setting, the full cache runs first, then every method at every budget, under one
progress bar ("run k of N"). The table gives, per setting, each task's score, the average, the
share of prompt tokens the cache kept (from the runs' own cache reports, so a run in which
nothing was compressed would show 1.00) and the samples scored of those expected; a score that
stands on fewer samples than expected (one shard of several, an interrupted run) is marked
``*``. The rows go to ``<save_dir>/sweep_<length>_table.csv`` and ``.json``
(``restkv.benchmarks.tables``: numbers as numbers, merged into what an earlier run wrote, never
shrunk by a partial rerun) and the figure, score against share kept with a panel per setting,
to ``.png`` beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from restkv.benchmarks import ruler, ruler_data, scoring, tables
from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import command_line
from restkv.benchmarks.flags import ATTN_IMPLEMENTATIONS, check_minimums, parse_args as parse_runner_args
from restkv.benchmarks.results import named_in_folder
from restkv.config import ConfigError, method_spec_options

DEFAULT_TASKS = "niah_single_1,niah_single_2,niah_multikey_1"
DEFAULT_METHODS = ("streamingllm", "snapkv", "restkv", "restkv_recon", "kvzip", "learned_zip")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.benchmarks.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024,
                        help="RULER sequence length (prompt + answer tokens; default: %(default)s)")
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated RULER tasks")
    parser.add_argument("--num_samples", "--max_num_examples", dest="num_samples", metavar="N", type=int, default=4,
                        help="samples per task (--max_num_examples: the runners' release name)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="method specs, each run at every budget after the full cache (default: %(default)s)")
    budgets = parser.add_mutually_exclusive_group()
    budgets.add_argument("--budgets", type=int, nargs="+",
                         help="max_capacity_prompts values (tokens per layer and KV head, window included)")
    budgets.add_argument("--compression_ratios", type=float, nargs="+", default=[0.9, 0.8],
                         help="fractions of each prompt removed (default: %(default)s, 10%% and 20%% kept)")
    setting = parser.add_mutually_exclusive_group()
    setting.add_argument("--query_agnostic", action="store_true",
                         help="only compress the context before the question (default: both settings)")
    setting.add_argument("--query_aware", action="store_true",
                         help="only compress the prompt with the question in it (default: both settings)")
    parser.add_argument("--multi_question", action="store_true",
                        help="compress each context once and ask about each of its needles (implies "
                        "--query_agnostic; niah tasks only)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens generated per answer at most "
                        "(default: %(default)s, room for any needle's value; RULER's own: 128 for niah tasks)")
    parser.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS,
                        help="attention kernel (default: sdpa)")
    parser.add_argument("--save_dir", default="results/sweep", help="data, run folders and table (default: "
                        "%(default)s)")
    parser.add_argument("--num_shards", type=int, default=1)
    parser.add_argument("--shard_id", type=int, default=0)
    add_config_flags(parser)
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
    if args.budgets:
        return [["--max_capacity_prompts", str(budget)] for budget in args.budgets]
    return [["--compression_ratio", str(ratio)] for ratio in args.compression_ratios]


def budget_label(flags: list[str]) -> str:
    """``full``, a token budget, or the kept share of a ratio budget (``--compression_ratio 0.9`` -> 10%)."""
    if not flags:
        return "full"
    if flags[0] == "--compression_ratio":
        return f"{round(100 * (1 - float(flags[1])))}%"
    return flags[1]


def settings(args: argparse.Namespace) -> list[bool]:
    """Whether each setting of the sweep is query-agnostic: both, unless a flag names one
    (``--multi_question`` is query-agnostic)."""
    if args.query_agnostic or args.multi_question:
        return [True]
    return [False] if args.query_aware else [False, True]


def configurations(args: argparse.Namespace) -> list[tuple[bool, str, list[str]]]:
    """(query-agnostic, method spec, budget flags) of every run: per setting, the full cache first,
    then every method at every budget."""
    return [(agnostic, spec, budget) for agnostic in settings(args)
            for spec, budget in [("fullkv", []), *((spec, budget) for budget in budget_flags(args)
                                                   for spec in args.methods)]]


def runner_args(args: argparse.Namespace, spec: str, budget: list[str], agnostic: bool) -> argparse.Namespace:
    """The RULER runner's flags of one configuration, checked (raises ``FlagError`` or ``ConfigError``)."""
    argv = [*method_flags(spec), *budget, "--model_path", args.model_path,
            "--data_dir", str(Path(args.save_dir) / "data"), "--context_lengths", str(args.length),
            "--datasets", ",".join(ruler.parse_task_list(args.tasks)),
            "--save_dir", str(runs_dir(args)), "--attn_implementation", args.attn_implementation,
            "--num_shards", str(args.num_shards), "--shard_id", str(args.shard_id),
            *(["--query_agnostic"] if agnostic else []),
            *(["--multi_question"] if args.multi_question else []),
            *(["--max_new_tokens", str(args.max_new_tokens)] if args.max_new_tokens is not None else []),
            *(token for plugin in args.plugin or [] for token in ("--plugin", plugin))]
    return parse_runner_args(ruler.BENCHMARK, argv, ruler.add_flags, raising=True)


def runs_dir(args: argparse.Namespace) -> Path:
    """Where the runs' folders go: ``<save_dir>/len<length>``, so sweeps at several lengths share a ``--save_dir``
    (a RULER run folder records its prompt limit, the length, and refuses another)."""
    return Path(args.save_dir) / f"len{args.length}"


def table_stem(args: argparse.Namespace) -> Path:
    """Where the sweep's table goes: ``<save_dir>/sweep_<length>[_multi]_table`` (.csv, .json, .png)."""
    return Path(args.save_dir) / f"sweep_{args.length}{'_multi' if args.multi_question else ''}_table"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The sweep's flags, with every configuration's runner flags and the table it merges into
    checked before anything runs; a bad value prints the sweep's usage."""
    args, parser = parse_command_line(build_parser, argv)
    if args.multi_question and args.query_aware:
        parser.error("--multi_question compresses each context before its questions: it cannot be --query_aware")
    try:
        tasks = ruler.parse_task_list(args.tasks)
        check_minimums(args, {"num_samples": 1})
        ruler_data.check_lengths(tasks, [args.length], flag="--length")
        for agnostic, spec, budget in configurations(args):
            runner_args(args, spec, budget, agnostic)
        tables.read_rows(tables.table_file(table_stem(args), ".json"))
    except (ConfigError, ValueError) as error:  # FlagError and DataError are ValueErrors
        parser.error(str(error))
    return args


def run_sweep(args: argparse.Namespace, model=None, tokenizer=None) -> list[dict]:
    """Generate the data, run every configuration (one progress bar over them all), return the
    table rows (``restkv.benchmarks.tables``) of every configuration: one per task, then its average."""
    from restkv.integrations.transformers.models import load_model, load_tokenizer

    tasks = ruler.parse_task_list(args.tasks)
    tokenizer = tokenizer or load_tokenizer(args.model_path)
    for task in tasks:
        ruler_data.write_task(Path(args.save_dir) / "data", task, args.length, args.num_samples, tokenizer,
                              args.model_path)
    model = model or load_model(args.model_path, attn_implementation=args.attn_implementation)
    rows = []
    runs = configurations(args)
    with tqdm(runs, unit="run", dynamic_ncols=True) as progress:
        for number, (agnostic, spec, budget) in enumerate(progress, start=1):
            progress.set_description(f"run {number} of {len(runs)}: {spec} {budget_label(budget)}")
            run = runner_args(args, spec, budget, agnostic)
            folder = ruler.run_args(run, model=model, tokenizer=tokenizer)
            rows += summarise(folder, spec, budget, run, [f"{args.length}/{task}" for task in tasks])
    return rows


def summarise(folder: Path, spec: str, budget: list[str], run: argparse.Namespace, datasets: list[str]) -> list[dict]:
    """A configuration's table rows: each task's score, samples and what the cache kept, then their average."""
    scores = scoring.score_run(folder, ruler.BENCHMARK, datasets=datasets, label=f"{spec} {budget_label(budget)}")
    method, _, options = spec.partition("+")
    ratio = float(budget[1]) if budget[:1] == ["--compression_ratio"] else None
    tokens = int(budget[1]) if budget[:1] == ["--max_capacity_prompts"] else None
    fields = {"model": run.model_path, "setting": _setting(run), "method": method, "options": options or None,
              "budget": tokens, "compression_ratio": ratio, "run": str(folder)}
    return scoring.table_rows(scores, ruler.BENCHMARK, fields)


def _setting(run: argparse.Namespace) -> str:
    if run.multi_question:
        return f"{tables.QUERY_AGNOSTIC}, one question per needle"
    return tables.QUERY_AGNOSTIC if run.query_agnostic else tables.QUERY_AWARE


def report(args: argparse.Namespace, rows: Sequence[dict]) -> str:
    """The sweep's table, per setting: a header line, one line per configuration (each task's
    score, the average and its standard error, the share of the cache kept, the samples scored
    of those expected; a score on fewer samples than expected marked ``*``), then the footnotes."""
    tasks = ruler.parse_task_list(args.tasks)
    shard = f" (shard {args.shard_id} of {args.num_shards})" if args.num_shards > 1 else ""
    blocks, notes = [], []
    columns = ["budget", *tasks, "avg", "± stderr", "kv kept", "samples"]
    for setting in dict.fromkeys(row["setting"] for row in rows):
        lines: dict[tuple, dict] = {}
        for row in (row for row in rows if row["setting"] == setting):
            name = tables.label(row)
            budget = tables.budget_label(row)
            line = lines.setdefault((name, budget), {"method": name, "budget": budget})
            incomplete = row["expected"] is not None and row["n"] < row["expected"]
            column = "avg" if row["task"] == tables.AVERAGE else row["task"].split("/")[-1]
            line[column] = scoring.mark(row["score"], incomplete)
            if row["task"] == tables.AVERAGE:
                line["± stderr"], line["kv kept"] = row["stderr"], row["kv_kept"]
                line["samples"] = f"{row['n']}/{'?' if row['expected'] is None else row['expected']}"
                continue
            if incomplete:
                notes.append(f"{scoring.INCOMPLETE} {name} {line['budget']} ({setting}) / {row['task']}: "
                             f"{row['n']}/{row['expected']} samples")
            if row["uncompressed"]:
                notes.append(f"  {name} {line['budget']} ({setting}) / {row['task']}: {row['uncompressed']} of "
                             f"{row['n']} samples answered with the full cache (prompt too short for the ratio budget)")
        blocks += [f"RULER {args.length} tokens, {args.num_samples} samples per task{shard}, {args.model_path}, "
                   f"{setting}",
                   scoring.format_table(list(lines.values()), columns, first="method"), ""]
    return "\n".join([*blocks[:-1], *notes])


@command_line
def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = run_sweep(args)
    print("\n" + report(args, rows))
    written = tables.write_results(rows, table_stem(args), title=f"{args.model_path}, RULER {args.length} tokens")
    print(f"(table: {written['csv']} and {written['json']}; figure: {written.get('png', 'none, nothing to draw')})")
    return rows


if __name__ == "__main__":
    main()
