"""LongBench (v1): datasets, official prompts and generation lengths, data files, scoring.

The prompt templates (``PROMPTS``), generation lengths (``MAX_NEW_TOKENS``), the chat-template
exceptions, the metric of each dataset and ``scorer``/``scorer_e`` come from THUDM/LongBench
(``LongBench/config/dataset2prompt.json``, ``dataset2maxlen.json``, ``pred.py``, ``eval.py``):
they define the benchmark and are reproduced byte for byte, typos included ("asconcisely").

* Data: ``<data_dir>/<dataset>.jsonl`` with the official fields (``REQUIRED_FIELDS``);
  LongBench-E files are ``<name>_e.jsonl`` (same fields, scored by length bucket too);
  ``python -m restkv.data longbench`` fetches them (``restkv.benchmarks.sources.LONGBENCH``).
* Prompt: ``PROMPTS[dataset].format(**record)``; its ``context`` part ends right after the
  ``{context}`` text, the rest (question and answer cue) is the ``question`` part that
  ``--query_agnostic`` feeds after compressing the context.
* Chat template for every dataset except ``RAW_COMPLETION_DATASETS`` (few-shot and code
  completion, left raw as in the official pred.py); samsum stops on EOS or a newline and
  generates at least one token (official pred.py).
* Scores: official metric per dataset, first-line cut for ``FIRST_LINE_DATASETS``, best gold
  answer per sample, ``round(100 * mean, 2)``.

``run`` and ``evaluate`` are the command lines of ``run_longbench.py`` and ``eval.py``.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from restkv.benchmarks import longbench_metrics as metrics, scoring
from restkv.benchmarks.benchmark import Benchmark, Sample
from restkv.benchmarks.errors import DataError, command_line
from restkv.benchmarks.results import read_jsonl, read_predictions
from restkv.benchmarks.runner import main as run_main
from restkv.benchmarks.scoring import RunScores, footnotes, format_table, marked, samples_cell
from restkv.benchmarks.sources import LONGBENCH
from restkv.benchmarks.tables import strict_json

#: The 16 English and code datasets, in the order of the papers' tables (the default set).
ENGLISH_DATASETS = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
CHINESE_DATASETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
DATASETS = ENGLISH_DATASETS + CHINESE_DATASETS

#: LongBench-E: the datasets with a ``<name>_e`` variant, sampled evenly over lengths.
E_SUFFIX = "_e"
LONGBENCH_E_DATASETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
ALL_DATASETS = DATASETS + tuple(name + E_SUFFIX for name in LONGBENCH_E_DATASETS)

#: Left without the chat template: chat models do better on few-shot and code completion raw.
RAW_COMPLETION_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

#: Predictions cut to their first line before scoring (the official eval.py rule).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

REQUIRED_FIELDS = {
    "input": str,
    "context": str,
    "answers": list,
    "length": int,
    "dataset": str,
    "language": str,
    "all_classes": (list, type(None)),
    "_id": str,
}

#: The official template of hotpotqa, 2wikimqa and musique (the same text for all three).
_PASSAGES_QA_PROMPT = (
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n"
    "\n"
    "The following are given passages.\n"
    "{context}\n"
    "\n"
    "Answer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n"
    "\n"
    "Question: {input}\n"
    "Answer:"
)

#: Official prompt templates (LongBench/config/dataset2prompt.json), byte for byte.
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n"
        "\n"
        "Story: {context}\n"
        "\n"
        "Now, answer the question based on the story asconcisely as you can, "
        "using a single phrase if possible. Do not provide any explanation.\n"
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. "
        "Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. "
        "If the question cannot be answered based on the information in the article, "
        'write "unanswerable". If the question is a yes/no question, answer "yes", "no", '
        'or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Article: {context}\n"
        "\n"
        " Answer the question based on the above article as concisely as you can, "
        "using a single phrase or sentence if possible. "
        "If the question cannot be answered based on the information in the article, "
        'write "unanswerable". If the question is a yes/no question, answer "yes", "no", '
        'or "unanswerable". Do not provide any explanation.\n'
        "\n"
        "Question: {input}\n"
        "\n"
        "Answer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n"
        "\n"
        "{context}\n"
        "\n"
        "Now, answer the following question based on the above text, "
        "only give me the answer and do not output any other words.\n"
        "\n"
        "Question: {input}\n"
        "Answer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n"
        "\n"
        "{context}\n"
        "\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n"
        "\n"
        "问题：{input}\n"
        "回答："
    ),
    "hotpotqa": _PASSAGES_QA_PROMPT,
    "2wikimqa": _PASSAGES_QA_PROMPT,
    "musique": _PASSAGES_QA_PROMPT,
    "dureader": (
        "请基于给定的文章回答下述问题。\n"
        "\n"
        "文章：{context}\n"
        "\n"
        "请基于上述文章回答下面的问题。\n"
        "\n"
        "问题：{input}\n"
        "回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n"
        "\n"
        "Report:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of the report.\n"
        "\n"
        "Summary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. "
        "Answer the query in one or more sentences.\n"
        "\n"
        "Transcript:\n"
        "{context}\n"
        "\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n"
        "\n"
        "Query: {input}\n"
        "Answer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n"
        "\n"
        "News:\n"
        "{context}\n"
        "\n"
        "Now, write a one-page summary of all the news.\n"
        "\n"
        "Summary:"
    ),
    "vcsum": (
        "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n"
        "会议记录：\n"
        "{context}\n"
        "\n"
        "会议总结："
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n"
        "\n"
        "{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. "
        "Only give me the answer and do not output any other words. "
        "The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n"
        "\n"
        "{context}\n"
        "\n"
        "{input}"
    ),
    "lsht": (
        "请判断给定新闻的类别，下面是一些例子。\n"
        "\n"
        "{context}\n"
        "{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are "
        "after removing duplicates. "
        "In other words, how many non-repeating paragraphs are there in total?\n"
        "\n"
        "{context}\n"
        "\n"
        "Please enter the final count of unique paragraphs after removing duplicates. "
        "The output format should only contain the number, such as 1, 2, 3, and so on.\n"
        "\n"
        "The final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. "
        "Please determine which paragraph the abstract is from.\n"
        "\n"
        "{context}\n"
        "\n"
        "The following is an abstract.\n"
        "\n"
        "{input}\n"
        "\n"
        "Please enter the number of the paragraph that the abstract is from. "
        'The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n'
        "\n"
        "The answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n"
        "\n"
        "{context}\n"
        "\n"
        "下面是一个摘要\n"
        "\n"
        "{input}\n"
        "\n"
        '请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n'
        "\n"
        "答案是："
    ),
    "lcc": (
        "Please complete the code given below. \n"
        "{context}Next line of code:\n"
    ),
    "repobench-p": (
        "Please complete the code given below. \n"
        "{context}{input}Next line of code:\n"
    ),
}

#: Official generation lengths (LongBench/config/dataset2maxlen.json).
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}

#: Official metric of each dataset (LongBench/eval.py).
DATASET_METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": metrics.qa_f1_score,
    "qasper": metrics.qa_f1_score,
    "multifieldqa_en": metrics.qa_f1_score,
    "multifieldqa_zh": metrics.qa_f1_zh_score,
    "hotpotqa": metrics.qa_f1_score,
    "2wikimqa": metrics.qa_f1_score,
    "musique": metrics.qa_f1_score,
    "dureader": metrics.rouge_zh_score,
    "gov_report": metrics.rouge_score,
    "qmsum": metrics.rouge_score,
    "multi_news": metrics.rouge_score,
    "vcsum": metrics.rouge_zh_score,
    "trec": metrics.classification_score,
    "triviaqa": metrics.qa_f1_score,
    "samsum": metrics.rouge_score,
    "lsht": metrics.classification_score,
    "passage_retrieval_en": metrics.retrieval_score,
    "passage_count": metrics.count_score,
    "passage_retrieval_zh": metrics.retrieval_zh_score,
    "lcc": metrics.code_sim_score,
    "repobench-p": metrics.code_sim_score,
}


def base_dataset(name: str) -> str:
    """The LongBench dataset a file name stands for (``qasper_e`` -> ``qasper``)."""
    if name in DATASETS:
        return name
    if name.endswith(E_SUFFIX) and name[: -len(E_SUFFIX)] in LONGBENCH_E_DATASETS:
        return name[: -len(E_SUFFIX)]
    raise DataError(f"unknown LongBench dataset {name!r}; known: {', '.join(ALL_DATASETS)}")


# --------------------------------------------------------------------------- data and prompts


def read_records(path: Path) -> list[dict]:
    """The records of one LongBench jsonl file, each checked for the official fields."""
    if not path.is_file():
        raise LONGBENCH.missing(path)
    records = []
    for number, record in read_jsonl(path):
        for name, kind in REQUIRED_FIELDS.items():
            if name not in record:
                raise DataError(f"{path}:{number}: missing field {name!r}")
            if not isinstance(record[name], kind) or isinstance(record[name], bool):
                raise DataError(
                    f"{path}:{number}: field {name!r} has type {type(record[name]).__name__}, "
                    f"expected {_type_names(kind)}"
                )
        records.append(record)
    return records


def _type_names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def prompt_parts(dataset: str, record: Mapping[str, Any]) -> tuple[str, str]:
    """``(context part, question part)`` of the official prompt; together they are exactly
    ``PROMPTS[dataset].format(**record)``."""
    template = PROMPTS[base_dataset(dataset)]
    before, after = template.split("{context}")
    return before.format(**record) + record["context"], after.format(**record)


def to_sample(dataset: str, record: Mapping[str, Any]) -> Sample:
    """A runner sample with the official prompt, length, chat and stop rules."""
    base = base_dataset(dataset)
    context, question = prompt_parts(dataset, record)
    samsum = base == "samsum"
    return Sample(
        id=record["_id"],
        context=context,
        question=question,
        max_new_tokens=MAX_NEW_TOKENS[base],
        fields={
            "answers": record["answers"],
            "all_classes": record["all_classes"],
            "length": record["length"],
            "language": record["language"],
            "input": record["input"],
        },
        chat=base not in RAW_COMPLETION_DATASETS,
        stop_tokens=("\n",) if samsum else (),
        min_new_tokens=1 if samsum else 0,
    )


def load_samples(args: argparse.Namespace, dataset: str, tokenizer=None) -> list[Sample]:
    path = Path(args.data_dir) / f"{dataset}.jsonl"
    return [to_sample(dataset, record) for record in read_records(path)]


# --------------------------------------------------------------------------- scoring


def _sample_score(dataset: str, prediction: str, answers: Sequence, all_classes) -> float:
    base = base_dataset(dataset)
    if base in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for answer in answers:
        score = max(score, DATASET_METRIC[base](prediction, answer, all_classes=all_classes))
    return score


def scorer(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence], all_classes) -> float:
    """Official dataset score: ``round(100 * mean of per-sample best scores, 2)``."""
    total = 0.0
    for prediction, golds in zip(predictions, answers):
        total += _sample_score(dataset, prediction, golds, all_classes)
    return round(100 * total / len(predictions), 2)


def length_bucket(length: int) -> str:
    """LongBench-E bucket of a ``length`` (words, or characters for Chinese)."""
    if length < 4000:
        return "0-4k"
    return "4-8k" if length < 8000 else "8k+"


def scorer_e(dataset: str, predictions: Sequence[str], answers: Sequence[Sequence],
             lengths: Sequence[int], all_classes) -> dict[str, float]:
    """Official LongBench-E scores per length bucket (NaN for an empty bucket)."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for prediction, golds, length in zip(predictions, answers, lengths):
        buckets[length_bucket(length)].append(_sample_score(dataset, prediction, golds, all_classes))
    return {name: round(100 * float(np.mean(scores)), 2) if scores else math.nan for name, scores in buckets.items()}


PREDICTION_FIELDS = ("pred", "answers", "all_classes")


def score_dataset(dataset: str, records: Sequence[Mapping[str, Any]]) -> float:
    """The official score of a dataset's prediction lines (one class list per dataset: the
    official eval.py takes the last line's)."""
    base_dataset(dataset)
    for record in records:
        for name in PREDICTION_FIELDS:
            if name not in record:
                raise DataError(f"{dataset}: the prediction of id {record.get('id')!r} lacks field {name!r}")
    return scorer(dataset, [r["pred"] for r in records], [r["answers"] for r in records], records[-1]["all_classes"])


def standard_datasets(names: Sequence[str]) -> list[str]:
    """What a run's average is over: the standard datasets present, else the LongBench-E ones
    (the plain mean KV-cache papers report)."""
    return [name for name in names if name in DATASETS] or list(names)


BENCHMARK = Benchmark(
    name="longbench",
    datasets=ALL_DATASETS,
    default_datasets=ENGLISH_DATASETS,
    load_samples=load_samples,
    score=score_dataset,
    default_data_dir="data/LongBench",
    average_over=standard_datasets,
)


def run(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    """``run_longbench.py``: parse flags, load and patch the model (unless given), run every dataset."""
    return run_main(BENCHMARK, argv, model=model, tokenizer=tokenizer)


# --------------------------------------------------------------------------- evaluation of results folders


def run_metrics(run: RunScores) -> dict[str, Any]:
    """``metrics.json`` of a run: each scored dataset's score, samples and length buckets, and
    the average."""
    results: dict[str, Any] = {}
    for name, score in run.datasets.items():
        if score.score is None:
            continue
        results[name] = {"score": score.score, "samples": score.scored}
        records = read_predictions(run.folder, name)
        if all(isinstance(record.get("length"), int) for record in records):
            predictions, answers = [r["pred"] for r in records], [r["answers"] for r in records]
            lengths = [r["length"] for r in records]
            results[name]["buckets"] = scorer_e(name, predictions, answers, lengths, records[-1]["all_classes"])
    average = math.nan if run.average is None else run.average
    return {"datasets": results, "average": average, "averaged_over": run.averaged_over}


def _table_order(names: set[str]) -> list[str]:
    return [name for name in ALL_DATASETS if name in names]


def _evaluate(results_dir: str | Path, datasets: Sequence[str] | None) -> tuple[list[RunScores], dict[str, dict]]:
    results_dir = Path(results_dir)
    runs = scoring.evaluate(BENCHMARK, results_dir, datasets)
    evaluations = {}
    for run in runs:
        evaluations[run.label] = run_metrics(run)
        (run.folder / "metrics.json").write_text(strict_json(evaluations[run.label]), encoding="utf-8")
    (results_dir / "results.json").write_text(strict_json(evaluations), encoding="utf-8")  # NaN as null
    columns = _table_order({name for evaluation in evaluations.values() for name in evaluation["datasets"]})
    with open(results_dir / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", *columns, "average"])
        for label, row in score_rows(evaluations, columns).items():
            writer.writerow([label, *("" if row.get(c) is None else row[c] for c in [*columns, "average"])])
    return runs, evaluations


def evaluate_results_dir(results_dir: str | Path, datasets: Sequence[str] | None = None) -> dict[str, dict]:
    """Evaluate every run below ``results_dir``: ``scores.json`` and ``metrics.json`` in each run
    folder, ``results.json`` / ``results.csv`` in ``results_dir``. Returns {run label: metrics}."""
    return _evaluate(results_dir, datasets)[1]


def score_rows(evaluations: Mapping[str, Mapping], columns: Sequence[str]) -> dict[str, dict[str, Any]]:
    """One row per run: dataset scores and the average (None where a run lacks a dataset)."""
    rows = {}
    for label, evaluation in evaluations.items():
        row: dict[str, Any] = {name: evaluation["datasets"][name]["score"]
                               for name in columns if name in evaluation["datasets"]}
        complete = all(name in row for name in columns)
        row["average"] = evaluation["average"] if complete else None
        rows[label] = row
    return rows


def format_evaluations(runs: Sequence[RunScores], evaluations: Mapping[str, Mapping], buckets: bool = False) -> str:
    """The score table (runs x datasets + average + samples scored, incomplete cells marked)
    and, for LongBench-E datasets (or all with ``buckets``), the length-bucket table."""
    columns = _table_order({name for evaluation in evaluations.values() for name in evaluation["datasets"]})
    rows = []
    for run in runs:
        row = score_rows(evaluations, columns)[run.label]
        for name in columns:
            if name in row:
                row[name] = marked(row[name], [run.datasets[name]])
        row["average"] = marked(row["average"], run.datasets.values())
        rows.append({"run": run.label, **row, "samples": samples_cell(run.datasets.values())})
    text = "\n".join([format_table(rows, [*columns, "average", "samples"]),
                      *(line for run in runs for line in footnotes(run.label, run.datasets))])
    bucket_rows = [
        {"run / dataset": f"{label} / {name}", **result["buckets"]}
        for label, evaluation in evaluations.items()
        for name, result in evaluation["datasets"].items()
        if "buckets" in result and (buckets or name.endswith(E_SUFFIX))
    ]
    if bucket_rows:
        text += "\n\nLongBench-E length buckets\n" + format_table(bucket_rows, ["0-4k", "4-8k", "8k+"], "run / dataset")
    incomplete = [label for label, row in score_rows(evaluations, columns).items() if row["average"] is None]
    if incomplete:
        text += f"\n\nno average for runs missing a dataset: {', '.join(incomplete)}"
    return text


@command_line
def evaluate(argv: Sequence[str] | None = None) -> dict[str, dict]:
    """``eval.py``: score every run under ``--results_dir``, print the tables, write the result files."""
    parser = argparse.ArgumentParser(
        description="Score LongBench predictions with the official metrics: per-dataset scores, average, "
        "length buckets."
    )
    parser.add_argument("--results_dir", required=True, help="a run folder, or a folder of run folders")
    parser.add_argument("--datasets", nargs="+", default=None, help="score only these datasets")
    parser.add_argument("--buckets", action="store_true",
                        help="print length buckets for every dataset (always for LongBench-E ones)")
    args = parser.parse_args(argv)
    runs, evaluations = _evaluate(args.results_dir, args.datasets)
    print(format_evaluations(runs, evaluations, buckets=args.buckets))
    print(f"\nwritten: {args.results_dir}/results.json, {args.results_dir}/results.csv")
    return evaluations
