"""The entry point of every ``run_*.py``: flags, then the session, then every dataset.

::

    from restkv.benchmarks import runner
    runner.main(BENCHMARK)                   # parse flags, load + patch, run, write

``main(benchmark, argv, add_flags=...)`` is ``flags.parse_args`` + ``run``; adapters with
extra flags pass ``add_flags(parser)``. Flags: ``restkv.benchmarks.flags``; the folder's name
and files: ``restkv.benchmarks.results``; its settings, data checks and locks:
``restkv.benchmarks.run_folder``; prompts: ``restkv.benchmarks.prompts``; generation and the
compression check: ``restkv.benchmarks.session``; scores: ``restkv.benchmarks.scoring``.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Callable, Sequence

from restkv.benchmarks.benchmark import Benchmark
from restkv.benchmarks.errors import command_line
from restkv.benchmarks.flags import parse_args, selected_datasets
from restkv.benchmarks.session import BenchmarkRun


def run(benchmark: Benchmark, args: argparse.Namespace, model=None, tokenizer=None,
        datasets: Sequence[str] | None = None) -> Path:
    """Run every dataset (``datasets``: the names the benchmark's files go by, default the
    flags' selection); returns the results folder."""
    names = selected_datasets(args, benchmark) if datasets is None else list(datasets)
    with contextlib.closing(BenchmarkRun.start(benchmark, args, names, model=model, tokenizer=tokenizer)) as session:
        for name in names:
            session.run_dataset(name)
    return session.folder


@command_line
def main(benchmark: Benchmark, argv: Sequence[str] | None = None,
         add_flags: Callable[[argparse.ArgumentParser], None] | None = None, model=None, tokenizer=None) -> Path:
    """Command-line entry point of a ``run_*.py``; ``model``/``tokenizer`` skip loading (tests, notebooks)."""
    args = parse_args(benchmark, argv, add_flags)
    folder = run(benchmark, args, model=model, tokenizer=tokenizer)
    print(f"predictions in {folder}")
    return folder
