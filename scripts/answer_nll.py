"""Answer likelihood under each compressed cache: a finer quality measure than exact match.

    python scripts/answer_nll.py --length 2048 --num_samples 8 --compression_ratios 0.9 0.8 \
        --methods streamingllm h2o snapkv snapkv+residual adakv adakv+residual restkv restkv+residual
    python scripts/answer_nll.py --budgets 128 256 --methods snapkv kvzip --config nll.yaml

On a small model most compressed runs score 0 or 100 on a needle task, so exact match hides
the differences between methods. This script measures, on the project's synthetic RULER
samples, the teacher-forced negative log-likelihood per token of the gold answer
(``restkv.integrations.transformers.generation.answer_nll``) with the full cache and with every method at every
budget, query-aware (context and question compressed together) and query-agnostic (context
compressed alone, then question and answer fed as new tokens). Lower is better; the table
gives the mean over samples, its standard error, and how many samples each method beats the
other variant of the same base on when run with ``+residual``.

Tasks default to the single-answer needle tasks (the gold continuation of the prompt's
answer prefix is then unambiguous). One line per (configuration, sample) goes to
``<save_dir>/answer_nll.jsonl`` as it is computed; a rerun skips what is there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks import ruler, ruler_data, tables
from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import ATTN_IMPLEMENTATIONS, check_attn_implementation, check_minimums, check_output_path
from restkv.benchmarks.prompts import encode_prompt
from restkv.benchmarks.scoring import format_table
from restkv.config import config_from_spec
from restkv.integrations.transformers.generation import answer_nll
from restkv.integrations.transformers.models import check_model_path, load_for_scoring
from restkv.integrations.transformers.patching import replace_for_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=2048, help="RULER sequence length")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1")
    parser.add_argument("--num_samples", "--max_num_examples", dest="num_samples", metavar="N", type=int, default=8,
                        help="samples per task (--max_num_examples: the runners' release name)")
    parser.add_argument("--methods", nargs="+", default=["streamingllm", "h2o", "snapkv", "restkv"],
                        help="METHOD or METHOD+SWITCH... (snapkv+residual)")
    budget_kinds = parser.add_mutually_exclusive_group()
    budget_kinds.add_argument("--budgets", type=int, nargs="+",
                              help="max_capacity_prompts values (tokens per layer and KV head, window included)")
    budget_kinds.add_argument("--compression_ratios", type=float, nargs="+", default=[0.9, 0.8],
                              help="fractions of each prompt removed, instead of --budgets (default: 0.9 0.8)")
    parser.add_argument("--settings", nargs="+", choices=["aware", "agnostic"], default=["aware", "agnostic"])
    parser.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--save_dir", default="results/answer_nll")
    add_config_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every method at every budget checked (a one-line error) before any work."""
    args, _ = parse_command_line(build_parser, argv)
    check_minimums(args, {"num_samples": 1, "threads": 1, "budgets": 1})
    try:
        tasks = ruler.parse_task_list(args.tasks)
    except ValueError as error:
        raise FlagError(f"--tasks: {error}") from None
    ruler_data.check_lengths(tasks, [args.length], flag="--length")
    for _, budget in budgets(args):
        for spec in args.methods:
            config_from_spec(spec, **budget)
    check_model_path(args.model_path)
    check_attn_implementation(args.attn_implementation)
    check_output_path(args.save_dir, "--save_dir", folder=True)
    return args


def budgets(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, budget option) of each budget: ``--budgets`` in tokens, else the share each ratio keeps."""
    if args.budgets:
        return [(str(tokens), {"max_capacity_prompts": tokens}) for tokens in args.budgets]
    return [(f"{1 - ratio:.0%}", {"compression_ratio": ratio}) for ratio in args.compression_ratios]


def load_samples(args: argparse.Namespace, tokenizer) -> list[tuple[str, Sample]]:
    data_dir = Path(args.save_dir) / "data"
    samples = []
    for task in ruler.parse_task_list(args.tasks):
        ruler_data.write_task(data_dir, task, args.length, args.num_samples, tokenizer, args.model_path)
        sample_args = argparse.Namespace(data_dir=str(data_dir), chat_template=True, multi_question=False)
        samples += [(task, sample) for sample in ruler.ruler_samples(sample_args, f"{args.length}/{task}")]
    return samples


@command_line
def main(argv: list[str] | None = None, model=None, tokenizer=None) -> list[dict]:
    """The command line; ``model``/``tokenizer`` skip loading (tests). Returns every record."""
    args = parse_args(argv)
    model, tokenizer = load_for_scoring(args.model_path, args.attn_implementation, args.threads, model, tokenizer)
    samples = load_samples(args, tokenizer)
    out = Path(args.save_dir) / "answer_nll.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if out.is_file():
        for line in out.read_text().splitlines():
            record = json.loads(line)
            done[(record["method"], record["budget"], record["setting"], record["task"], record["id"])] = record
    configs = [("fullkv", ("full", {}), setting) for setting in args.settings] + [
        (spec, budget, setting) for budget in budgets(args) for spec in args.methods for setting in args.settings
    ]
    with open(out, "a") as handle, torch.no_grad():
        for spec, (budget, budget_option), setting in tqdm(configs, desc="configurations", unit="config"):
            replace_for_model(model, config_from_spec(spec, **budget_option))
            for task, sample in samples:
                key = (spec, budget, setting, task, sample.id)
                if key in done:
                    continue
                encoded = encode_prompt(tokenizer, sample, args.length, split=setting == "agnostic")
                gold = tokenizer(" " + " ".join(sample.fields["outputs"]), add_special_tokens=False).input_ids
                prompt = torch.tensor([encoded.context_ids])
                question = torch.tensor([encoded.question_ids]) if encoded.question_ids else None
                nll = answer_nll(model, prompt, torch.tensor([gold]), question_ids=question,
                                 context_span=encoded.context_span)
                done[key] = dict(method=spec, budget=budget, setting=setting, task=task, id=sample.id,
                                 nll=float(nll.mean()), answer_tokens=len(gold))
                handle.write(json.dumps(done[key]) + "\n")
                handle.flush()
    print_summary(args, list(done.values()), [(task, s.id) for task, s in samples])
    written = tables.write_results(nll_rows(args, list(done.values()), [(task, s.id) for task, s in samples]),
                                   Path(args.save_dir) / "answer_nll_table")
    print(f"\n(table: {written['csv']} and {written['json']}; score = mean answer NLL per token)")
    return list(done.values())


def print_summary(args: argparse.Namespace, records: list[dict], sample_keys: list[tuple[str, str]]) -> None:
    wanted = set(sample_keys)
    by_config: dict[tuple, dict] = {}
    for record in records:
        if (record["task"], record["id"]) in wanted:
            by_config.setdefault((record["method"], record["budget"], record["setting"]), {})[
                (record["task"], record["id"])] = record["nll"]
    for setting in args.settings:
        rows = []
        for (method, budget, row_setting), values in by_config.items():
            if row_setting != setting:
                continue
            nlls = list(values.values())
            row = dict(method=method, budget=budget, samples=len(nlls), nll=f"{statistics.mean(nlls):.3f}",
                       stderr=f"{statistics.stdev(nlls) / math.sqrt(len(nlls)):.3f}" if len(nlls) > 1 else "-")
            base = by_config.get((method.replace("+residual", ""), budget, setting))
            if method.endswith("+residual") and base:
                shared = [k for k in values if k in base]
                row["better than base"] = f"{sum(values[k] < base[k] for k in shared)}/{len(shared)}"
                row["mean change"] = f"{statistics.mean(values[k] - base[k] for k in shared):+.3f}"
            rows.append(row)
        print(f"\nanswer NLL per token (lower is better), {args.model_path}, RULER {args.length}, query-{setting}")
        print(format_table(rows, ["budget", "samples", "nll", "stderr", "better than base", "mean change"],
                           first="method"))


def nll_rows(args: argparse.Namespace, records: list[dict], sample_keys: list[tuple[str, str]]) -> list[dict]:
    """The results table's rows (``restkv.benchmarks.tables``): per configuration, each task's
    mean answer NLL as its score (lower is better) with its stderr, then the mean over tasks."""
    wanted, options = set(sample_keys), dict(budgets(args))
    values: dict[tuple, dict[str, list[float]]] = {}
    for record in records:
        if (record["task"], record["id"]) in wanted:
            config = (record["setting"], record["method"], record["budget"])
            values.setdefault(config, {}).setdefault(record["task"], []).append(record["nll"])
    rows = []
    for (setting, spec, budget), per_task in values.items():
        method, _, variant = spec.partition("+")
        option = options.get(budget, {})
        described = {"benchmark": "answer_nll", "model": args.model_path, "setting": f"query-{setting}",
                     "method": method, "options": variant or None, "budget": option.get("max_capacity_prompts"),
                     "compression_ratio": option.get("compression_ratio"), "expected": args.num_samples,
                     "run": str(Path(args.save_dir) / "answer_nll.jsonl")}
        for task, nlls in per_task.items():
            rows.append({**described, "task": f"{args.length}/{task}", "score": round(statistics.mean(nlls), 4),
                         "n": len(nlls), "stderr": tables.stderr(nlls)})
        means = [statistics.mean(nlls) for nlls in per_task.values()]
        rows.append({**described, "task": tables.AVERAGE, "score": round(statistics.mean(means), 4),
                     "n": sum(len(nlls) for nlls in per_task.values()), "expected": args.num_samples * len(per_task),
                     "stderr": None})
    return rows


if __name__ == "__main__":
    main()
