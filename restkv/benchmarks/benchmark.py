"""What a benchmark adapter declares: its datasets, how a data file becomes samples, how a
dataset's predictions are scored.

An adapter (``restkv.benchmarks.longbench``, ``ruler``, ``needle``, ``infinitebench``) fills
one ``Benchmark``; the runner (``restkv.benchmarks.runner``) and the evaluator
(``restkv.benchmarks.scoring``) do the rest the same way for every benchmark::

    BENCH = Benchmark("mybench", datasets=("a", "b"), default_datasets=("a",),
                      load_samples=load_samples, score=score, default_data_dir="data/MyBench")
    runner.main(BENCH)                           # parse flags, check data, load + patch, run
    scoring.evaluate(BENCH, "results/mybench")   # scores.json in every run folder
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence


@dataclass(frozen=True)
class Question:
    """One of the questions a multi-question sample asks about its context.

    text: follows the context, as ``Sample.question`` does; answer_prefix: starts its answer;
    fields: copied into its output line after the sample's own (its gold answers).
    """

    text: str
    answer_prefix: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """One prompt to answer, or one context and several questions.

    id: unique within its dataset (resume and merge key).
    context: the part compressed alone under ``--query_agnostic`` (instruction + documents).
    question: the rest of the prompt; ``context + question`` is the full prompt.
    max_new_tokens: the benchmark's generation length (``--max_new_tokens`` overrides it).
    fields: copied into the output line (answers, lengths, ... whatever the scorer needs).
    chat: wrap in the tokenizer's chat template (ignored when the tokenizer has none).
    answer_prefix: appended after the chat wrapper, so it starts the answer (RULER).
    stop_tokens: texts whose last token also ends generation (LongBench samsum: ``"\\n"``).
    min_new_tokens: generate at least this many tokens before a stop token counts.
    questions: a multi-question sample (``question`` and ``answer_prefix`` then empty): the
        context is compressed once and every question is answered from it alone
        (``restkv.integrations.transformers.generation.answer_many``, so query-agnostic whatever the flags), one output
        line each (``line_ids``), each as ``single_question`` would answer it.
    """

    id: str
    context: str
    question: str
    max_new_tokens: int
    fields: Mapping[str, Any] = field(default_factory=dict)
    chat: bool = True
    answer_prefix: str = ""
    stop_tokens: tuple[str, ...] = ()
    min_new_tokens: int = 0
    questions: tuple[Question, ...] = ()

    def __post_init__(self) -> None:
        if self.questions and (self.question or self.answer_prefix):
            raise ValueError(f"sample {self.id!r} has questions, so no question or answer_prefix of its own")

    @property
    def line_ids(self) -> list[str]:
        """The ids of the sample's output lines: its own, or ``<id>/<k>`` for its k-th question."""
        return [f"{self.id}/{k}" for k in range(len(self.questions))] if self.questions else [self.id]

    def single_question(self, k: int) -> "Sample":
        """The one-question sample of the context and question ``k``: its line's id and fields."""
        question = self.questions[k]
        return replace(self, id=self.line_ids[k], question=question.text, answer_prefix=question.answer_prefix,
                       fields={**self.fields, **question.fields}, questions=())


@dataclass(frozen=True)
class Benchmark:
    """What the runner and the evaluator need from a benchmark adapter.

    load_samples(args, dataset, tokenizer) returns the dataset's samples in file order (only
    prompts built from tokens, the needle's, need the tokenizer); it raises ``DataError`` (file,
    line, field) on malformed input. Every requested dataset is loaded before the model, so bad
    data fail early, and again when its turn comes. ``prediction_flags`` name the
    benchmark's own flags that change a prediction (a chat template, generation lengths):
    they join the run settings, so a folder never mixes predictions made with other values.

    score(dataset, records) is the dataset's metric: its score (0-100) over its prediction
    lines (never empty); it raises ``DataError`` for an unknown dataset or a line without the
    fields it reads. ``prediction_glob`` says where a run folder's prediction files lie,
    relative to it (RULER's datasets are ``<length>/<task>``); ``average_over(datasets)``
    picks the datasets whose plain mean is a run's average (default: all). ``check_flags(args)``
    raises ``FlagError`` for a bad value of the benchmark's own flags (run when they are parsed).
    """

    name: str
    datasets: tuple[str, ...]
    default_datasets: tuple[str, ...]
    load_samples: Callable[[argparse.Namespace, str, Any], list[Sample]]
    score: Callable[[str, Sequence[Mapping[str, Any]]], float]
    default_data_dir: str | None
    prediction_flags: tuple[str, ...] = ()
    prediction_glob: str = "*.jsonl"
    average_over: Callable[[Sequence[str]], list[str]] | None = None
    check_flags: Callable[[argparse.Namespace], None] | None = None
