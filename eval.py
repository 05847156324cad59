"""Score LongBench predictions with the official metrics: per-dataset scores, average, length buckets.

    python eval.py --results_dir results/longbench/smollm2-135m

``--results_dir`` is one run folder (``<method>_<budget>``) or a folder above several; each
run gets a row. Writes ``metrics.json`` in every run folder and ``results.json`` and
``results.csv`` in ``--results_dir``. Official-format prediction files (``pred``,
``answers``, ``all_classes``, ``length`` per line) are scored the same way.
"""

import argparse
import sys

from restkv.benchmarks import longbench
from restkv.benchmarks.runner import DataError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results_dir", required=True, help="a run folder, or a folder of run folders")
    parser.add_argument("--datasets", nargs="+", default=None, help="score only these datasets")
    parser.add_argument("--buckets", action="store_true",
                        help="print length buckets for every dataset (always for LongBench-E ones)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        evaluations = longbench.evaluate_results_dir(args.results_dir, args.datasets)
    except DataError as error:
        sys.exit(f"error: {error}")
    print(longbench.format_evaluations(evaluations, buckets=args.buckets))
    print(f"\nwritten: {args.results_dir}/results.json, {args.results_dir}/results.csv")
    return evaluations


if __name__ == "__main__":
    main()
