"""Draw the project's figures from result files (PNG, no notebook needed).

    python visualization/visualize.py needle --results results/needle/smollm2-135m/snapkv_128
    python visualization/visualize.py budget --results_root results/longbench/smollm2-135m
    python visualization/visualize.py table --table results/sweep/sweep_512_table.json
    python visualization/visualize.py efficiency --results results/efficiency.json
    python visualization/visualize.py attention --model_path smollm2-135m --layer 12 --head 0 \
        --method snapkv --max_capacity_prompts 64 --length 512

* needle: the classic heatmap (depth × token limit, mean score) of ``needle_results.json``;
* budget: score vs KV budget per method, from every run folder under ``--results_root`` that
  has been scored (LongBench ``metrics.json``, ``ruler_scores.json``, ``infinite_scores.json``,
  ``needle_results.json``);
* table: score vs the share of the cache kept, from the results table a sweep or an eval wrote
  (``restkv.benchmarks.tables``; they draw it themselves beside the table: this redraws it);
* efficiency: prefill, decode and cache size vs prompt length (``scripts/efficiency.py`` rows);
* attention: one layer/head's attention on a RULER needle prompt, full cache vs compressed.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Sequence

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from visualization import figures  # noqa: E402  # isort: skip (after the path above)



def plot_needle(args: argparse.Namespace) -> Path:
    from restkv.benchmarks.needle import read_results

    results = Path(args.results)
    path = results / "needle_results.json" if results.is_dir() else results
    out = Path(args.out) if args.out else path.with_name("needle_heatmap.png")
    title = args.title if args.title is not None else path.parent.name
    figures.needle_heatmap(read_results(path), out, title=title, pretrained_length=args.pretrained_length)
    return out


def plot_budget(args: argparse.Namespace) -> Path:
    rows = figures.read_run_scores(args.results_root)
    out = Path(args.out) if args.out else Path(args.results_root) / "budget_curves.png"
    figures.budget_curves(rows, out, title=args.title or "")
    return out


def plot_table(args: argparse.Namespace) -> Path:
    from restkv.benchmarks.tables import read_rows, score_figure

    if not Path(args.table).is_file():
        raise SystemExit(f"--table {args.table}: no such file")
    out = Path(args.out) if args.out else Path(args.table).with_suffix(".png")
    score_figure(read_rows(args.table), out, title=args.title or "")
    return out


def plot_efficiency(args: argparse.Namespace) -> Path:
    rows = json.loads(Path(args.results).read_text(encoding="utf-8"))
    out = Path(args.out) if args.out else Path(args.results).with_suffix(".png")
    figures.efficiency_plot(rows, out, title=args.title or "")
    return out


def plot_attention(args: argparse.Namespace) -> Path:
    import torch

    from restkv import CompressionConfig
    from restkv.benchmarks import ruler
    from restkv.benchmarks.ruler_data import generate_task
    from restkv.integrations.transformers.models import load_model, load_tokenizer, model_label
    from visualization.attention_maps import layer_attention

    options = {"method": args.method, "max_capacity_prompts": args.max_capacity_prompts}
    for item in args.option:
        name, _, value = item.partition("=")
        try:
            options[name] = ast.literal_eval(value)  # numbers, True/False, tuples
        except (ValueError, SyntaxError):
            options[name] = value
    config = CompressionConfig.from_options(**options)
    tokenizer = load_tokenizer(args.model_path)
    model = load_model(args.model_path, attn_implementation="eager", dtype="float32")
    (sample,) = generate_task("niah_single_1", args.length, 1, tokenizer, seed=args.seed)
    prompt = ruler.build_prompt(sample, tokenizer, use_chat_template=True)
    use_chat = bool(getattr(tokenizer, "chat_template", None))
    ids = tokenizer(prompt, add_special_tokens=not use_chat, return_tensors="pt").input_ids
    needle_at = len(tokenizer(prompt[: prompt.find(sample["outputs"][0])], add_special_tokens=not use_chat).input_ids)
    with torch.no_grad():
        maps = layer_attention(model, ids, args.layer, args.head, config, last_queries=args.last_queries)
    out = Path(args.out) if args.out else Path("results") / (
        f"attention_{model_label(args.model_path)}_{args.method}_{args.max_capacity_prompts}"
        f"_layer{args.layer}_head{args.head}.png")
    fate = "kept" if needle_at in maps.kept else "evicted"
    title = args.title or (f"{model_label(args.model_path)}, layer {args.layer}, head {args.head}, "
                           f"{args.method} {args.max_capacity_prompts}: needle {fate}")
    figures.attention_maps(maps.before, maps.after, maps.kept, out, title=title,
                           marks={"needle": needle_at}, first_query=maps.first_query)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="figure", required=True)

    needle = commands.add_parser("needle", help="needle-in-a-haystack heatmap")
    needle.add_argument("--results", required=True, help="needle_results.json, or the run folder holding it")
    needle.add_argument("--pretrained_length", type=int, default=None, help="dashed line at this token limit")
    needle.set_defaults(draw=plot_needle)

    budget = commands.add_parser("budget", help="score vs budget curves per method")
    budget.add_argument("--results_root", required=True, help="folder above the scored run folders")
    budget.set_defaults(draw=plot_budget)

    table = commands.add_parser("table", help="score vs share of the cache kept, from a results table")
    table.add_argument("--table", required=True, help="the JSON of a sweep's or an eval's results table")
    table.set_defaults(draw=plot_table)

    efficiency = commands.add_parser("efficiency", help="prefill / decode / memory vs context length")
    efficiency.add_argument("--results", default="results/efficiency.json", help="rows of scripts/efficiency.py")
    efficiency.set_defaults(draw=plot_efficiency)

    attention = commands.add_parser("attention", help="one layer/head's attention before and after compression")
    attention.add_argument("--model_path", default="smollm2-135m")
    attention.add_argument("--layer", type=int, default=12)
    attention.add_argument("--head", type=int, default=0, help="query head")
    attention.add_argument("--method", default="snapkv")
    attention.add_argument("--max_capacity_prompts", type=int, default=64)
    attention.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                           help="another CompressionConfig option, e.g. --option pooling=maxpool")
    attention.add_argument("--length", type=int, default=512, help="tokens of the RULER niah_single_1 prompt")
    attention.add_argument("--last_queries", type=int, default=None, help="draw only the last N query rows")
    attention.add_argument("--seed", type=int, default=42)
    attention.set_defaults(draw=plot_attention)

    for command in (needle, budget, table, efficiency, attention):
        command.add_argument("--out", default=None, help="PNG path (default: beside the results)")
        command.add_argument("--title", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    out = args.draw(args)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
