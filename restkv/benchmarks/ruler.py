"""RULER: task definitions, data files, prompts, post-processing and metrics.

Everything here follows NVIDIA/RULER (``scripts/synthetic.yaml``,
``scripts/data/synthetic/constants.py``, ``scripts/eval/evaluate.py``):

* 13 tasks in 5 families; the templates, answer prefixes and tokens to generate are RULER's,
  verbatim (they are part of the benchmark's definition);
* a data file is ``<data_dir>/<length>/<task>/validation.jsonl`` as RULER's ``prepare.py``
  writes it (fields ``index, input, outputs, length, length_w_model_temp, answer_prefix``),
  or the ReST-KV release's flat ``<data_dir>/<length>/<task>.jsonl``;
* the prompt is ``input`` (inside the model's chat template when one is used) followed by
  ``answer_prefix``; older RULER data have the prefix inside ``input`` and no such field;
* a prediction is stripped, control characters become newlines, and it is stripped again;
  ``string_match_all`` (fraction of gold strings contained, case-insensitive) scores the
  niah/vt/cwe/fwe tasks and ``string_match_part`` (any gold string contained) the qa tasks,
  both as ``round(100 * mean, 2)``; the score at a length is the plain mean over its tasks.

``--multi_question`` (not RULER's; niah tasks, data from ``restkv.benchmarks.ruler_data``,
which records every needle) compresses a sample's context once and asks about each needle
alone, in the template's wording for one key; every question is a line (``<sample>/<k>``)
scored by the same metric against that needle's values, so a task's score is the mean over
its questions of the share of each needle's values found.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from restkv.benchmarks import runner, scoring
from restkv.benchmarks.benchmark import Benchmark, Question, Sample
from restkv.benchmarks.errors import DataError, FlagError, command_line
from restkv.benchmarks.flags import parse_args, selected_datasets
from restkv.benchmarks.prompts import chat_wrap
from restkv.benchmarks.results import read_jsonl
from restkv.benchmarks.scoring import RunScores, footnotes, format_table, marked, samples_cell


@dataclass(frozen=True)
class TaskFamily:
    """One of RULER's generators: its template, answer prefix, output length and metric."""

    name: str
    tokens_to_generate: int
    template: str
    answer_prefix: str
    metric: str  # "all" (string_match_all) or "part" (string_match_part)


FAMILIES = {
    family.name: family
    for family in (
        TaskFamily(
            "niah",
            128,
            "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
            " The special magic {type_needle_v} for {query} mentioned in the provided text are",
            "all",
        ),
        TaskFamily(
            "variable_tracking",
            30,
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.",
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
            "assigned the value {query}, they are: ",
            "all",
        ),
        TaskFamily(
            "common_words_extraction",
            120,
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n{context}\n"
            "Question: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:",
            "all",
        ),
        TaskFamily(
            "freq_words_extraction",
            50,
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. {context}\n"
            "Question: Do not provide any explanation. Please ignore the dots '....'. "
            "What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:",
            "all",
        ),
        TaskFamily(
            "qa",
            32,
            "Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nThe following are given documents.\n\n{context}\n\n"
            "Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nQuestion: {query}",
            " Answer:",
            "part",
        ),
    )
}


@dataclass(frozen=True)
class RulerTask:
    """A RULER task: a family plus its complexity arguments (RULER's ``synthetic.yaml``)."""

    name: str
    family_name: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def family(self) -> TaskFamily:
        return FAMILIES[self.family_name]

    @property
    def tokens_to_generate(self) -> int:
        return self.family.tokens_to_generate

    @property
    def metric(self) -> str:
        return self.family.metric


def _niah(name: str, haystack: str, key: str, value: str, k: int = 1, v: int = 1, q: int = 1) -> RulerTask:
    return RulerTask(
        name,
        "niah",
        {
            "type_haystack": haystack,
            "type_needle_k": key,
            "type_needle_v": value,
            "num_needle_k": k,
            "num_needle_v": v,
            "num_needle_q": q,
        },
    )


TASKS = {
    task.name: task
    for task in (
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", k=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", v=4),
        _niah("niah_multiquery", "essay", "words", "numbers", q=4),
        RulerTask("vt", "variable_tracking", {"type_haystack": "noise", "num_chains": 1, "num_hops": 4}),
        RulerTask("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10, "num_fewshot": 1}),
        RulerTask("fwe", "freq_words_extraction", {"alpha": 2.0, "coded_wordlen": 6}),
        RulerTask("qa_1", "qa", {"dataset": "squad"}),
        RulerTask("qa_2", "qa", {"dataset": "hotpotqa"}),
    )
}

# The 11 tasks that need no external data set (the ReST-KV paper's RULER set).
SYNTHETIC_TASKS = tuple(name for name, task in TASKS.items() if task.family_name != "qa")
# The tasks whose data files record every inserted needle, so --multi_question can ask about each.
MULTI_QUESTION_TASKS = tuple(name for name, task in TASKS.items() if task.family_name == "niah")
#: the folder name's part that keeps --multi_question runs apart (``snapkv_128_agnostic_multi``)
MULTI_QUESTION_TAG = "multi"

#: RULER's singular wording of a niah prompt that asks for one value
NIAH_SINGULAR = (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer"))


def niah_prompt(type_needle_v: str, query: str, values_asked: int, context: str) -> tuple[str, str]:
    """RULER's niah ``input`` and answer prefix asking for ``query``'s value(s) (``query`` is one
    key, or RULER's "a, b, and c"), in its singular wording when one value is asked for."""
    family = FAMILIES["niah"]
    template, prefix, shown_type = family.template, family.answer_prefix, type_needle_v
    if values_asked == 1:
        for old, new in NIAH_SINGULAR:
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        shown_type = type_needle_v[:-1]
    return (template.format(type_needle_v=shown_type, context=context, query=query),
            prefix.format(type_needle_v=shown_type, query=query))


def get_task(name: str) -> RulerTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)}") from None


def parse_task_list(values: Sequence[str] | str) -> list[str]:
    """Task names from ``a,b c`` style command-line values; ``all`` = every task, ``synthetic`` = the 11."""
    if isinstance(values, str):
        values = [values]
    names: list[str] = []
    for value in values:
        for name in filter(None, (part.strip() for part in value.split(","))):
            expanded = {"all": list(TASKS), "synthetic": list(SYNTHETIC_TASKS)}.get(name, [name])
            for item in expanded:
                get_task(item)
                if item not in names:
                    names.append(item)
    if not names:
        raise ValueError("no RULER task given")
    return names


# ----------------------------------------------------------------------------- data files


def task_file_candidates(data_dir: str | Path, length: int, task: str) -> list[Path]:
    """Where a task's data may live: RULER's layouts first, then the ReST-KV flat layout."""
    root = Path(data_dir) / str(length)
    return [
        root / task / "validation.jsonl",
        root / "data" / task / "validation.jsonl",
        root / f"{task}.jsonl",
    ]


def find_task_file(data_dir: str | Path, length: int, task: str) -> Path:
    candidates = task_file_candidates(data_dir, length, task)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"no RULER data for task {task!r} at length {length}; looked for "
        + ", ".join(str(p) for p in candidates)
        + f". Generate it with: {generate_command(data_dir, length, task)}"
    )


def generate_command(data_dir: str | Path, length: int | str, task: str) -> str:
    """The command that writes a task's data file (``python -m restkv.data ruler``: the project's generator,
    ``restkv.benchmarks.ruler_data``; RULER's data are generated, never downloaded)."""
    return f"python -m restkv.data ruler --tokenizer MODEL --lengths {length} --tasks {task} --out {data_dir}"


def read_samples(path: str | Path) -> list[dict]:
    """The samples of a RULER data file; each needs ``input`` and ``outputs`` (a list of strings)."""
    samples = []
    for line_number, sample in read_jsonl(path):
        if "input" not in sample or "outputs" not in sample:
            raise ValueError(f"{path}:{line_number}: a RULER sample needs 'input' and 'outputs'")
        if isinstance(sample["outputs"], str):
            sample["outputs"] = [sample["outputs"]]
        samples.append(sample)
    return samples


def load_task(data_dir: str | Path, length: int, task: str) -> list[dict]:
    get_task(task)
    return read_samples(find_task_file(data_dir, length, task))


# ----------------------------------------------------------------------------- prompts


#: Where each family's question starts in ``input`` (its last occurrence): the part before is
#: the context a query-agnostic run compresses alone.
QUESTION_MARKERS = {
    "niah": "\nWhat ",
    "variable_tracking": "\nQuestion: Find all variables",
    "common_words_extraction": "\nQuestion: What are the",
    "freq_words_extraction": "\nQuestion: Do not provide any explanation.",
    "qa": "\n\nAnswer the question based on the given documents.",
}


def split_question(task: str, text: str) -> tuple[str, str]:
    """(context, question) of a RULER ``input``; the question is empty if its marker is absent."""
    position = text.rfind(QUESTION_MARKERS[get_task(task).family_name])
    if position <= 0:
        return text, ""
    return text[:position], text[position:]


def build_prompt(sample: Mapping, tokenizer, use_chat_template: bool) -> str:
    """RULER's prompt: the (chat-wrapped) ``input`` followed by ``answer_prefix``.

    The prefix starts the assistant's turn, as RULER appends it after its model template;
    a tokenizer without a chat template gets ``input`` unchanged (RULER's ``base`` template).
    """
    return chat_wrap(tokenizer, sample["input"], use_chat_template) + sample.get("answer_prefix", "")


# ----------------------------------------------------------------------------- metrics

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(prediction: str) -> str:
    """RULER's clean-up: strip, control characters to newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def sample_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of the gold strings contained in the prediction (case-insensitive)."""
    lowered = prediction.lower()
    return sum(ref.lower() in lowered for ref in references) / len(references)


def sample_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any gold string is contained in the prediction (case-insensitive)."""
    lowered = prediction.lower()
    return float(any(ref.lower() in lowered for ref in references))


def _mean_percent(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("cannot score an empty list of predictions")
    return round(sum(values) / len(values) * 100, 2)


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    return _mean_percent([sample_match_all(p, r) for p, r in zip(predictions, references, strict=True)])


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    return _mean_percent([sample_match_part(p, r) for p, r in zip(predictions, references, strict=True)])


def score_task(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """A task's RULER score (0-100) after RULER's post-processing of each prediction."""
    metric = string_match_all if get_task(task).metric == "all" else string_match_part
    return metric([postprocess_prediction(p) for p in predictions], references)


def ordered_tasks(names: Iterable[str]) -> list[str]:
    """RULER's task order for known tasks, then any others alphabetically."""
    names = set(names)
    return [t for t in TASKS if t in names] + sorted(names - set(TASKS))


def score_table(scores: Mapping[int | str, Mapping[str, float]]) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows): one row per context length plus, over several lengths, a ``mean`` row.

    Columns are the tasks in RULER's order, then ``Avg`` (the mean over a row's tasks). A task
    missing at a length is absent from that row and left out of its average.
    """
    lengths = sorted(scores, key=int)
    tasks = ordered_tasks({t for per_length in scores.values() for t in per_length})
    rows = []
    for length in lengths:
        values = {t: scores[length][t] for t in tasks if t in scores[length]}
        rows.append({"length": str(length), **values, "Avg": round(sum(values.values()) / len(values), 2)})
    if len(rows) > 1:
        mean_row: dict[str, Any] = {"length": "mean"}
        for column in [*tasks, "Avg"]:
            present = [row[column] for row in rows if column in row]
            mean_row[column] = round(sum(present) / len(present), 2)
        rows.append(mean_row)
    return [*tasks, "Avg"], rows


def write_scores(scores: Mapping[int | str, Mapping[str, float]], out_dir: str | Path) -> tuple[Path, Path]:
    """``ruler_scores.json`` ({length: {task: score}}) and ``ruler_scores.csv`` (the table) in ``out_dir``."""
    out_dir = Path(out_dir)
    json_path, csv_path = out_dir / "ruler_scores.json", out_dir / "ruler_scores.csv"
    ordered = {str(length): dict(scores[length]) for length in sorted(scores, key=int)}
    json_path.write_text(json.dumps(ordered, indent=2) + "\n", encoding="utf-8")
    columns, rows = score_table(scores)
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=["length", *columns])
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


# ----------------------------------------------------------------------------- running


def ruler_samples(args: argparse.Namespace, dataset: str, tokenizer=None) -> list[Sample]:
    """The samples of ``dataset`` = ``"<length>/<task>"``; ids are line numbers (niah's index is
    not unique). Under ``--multi_question`` a sample asks about each of its needles."""
    length, task = dataset.split("/")
    try:
        get_task(task)
        path = find_task_file(args.data_dir, int(length), task)
        records = read_samples(path)
    except (ValueError, KeyError) as error:
        raise DataError(str(error)) from None
    samples = []
    for position, record in enumerate(records):
        context, question = split_question(task, record["input"])
        common = dict(id=str(position), context=context, max_new_tokens=get_task(task).tokens_to_generate,
                      chat=args.chat_template)
        if args.multi_question:
            sample = Sample(question="", fields={"length": record.get("length")},
                            questions=needle_questions(task, record, path, position,
                                                       generate_command(args.data_dir, length, task)), **common)
        else:
            sample = Sample(question=question, fields={"outputs": record["outputs"], "length": record.get("length")},
                            answer_prefix=record.get("answer_prefix", ""), **common)
        samples.append(sample)
    return samples


def needle_questions(task: str, record: Mapping[str, Any], path: Path, position: int,
                     regenerate: str) -> tuple[Question, ...]:
    """One question per needle a niah sample records, in RULER's wording for that key alone,
    whose gold ``outputs`` are that needle's values (``regenerate``: the command that writes
    the file anew, for the error when it records no needles)."""
    needles = record.get("needles")
    if not isinstance(needles, list) or not needles or not all(
            isinstance(n, dict) and isinstance(n.get("key"), str) and isinstance(n.get("values"), list) and n["values"]
            for n in needles):
        raise DataError(
            f"{path}: sample {position} has no 'needles' list of {{'key', 'values'}}, which --multi_question asks "
            f"about (RULER's prepare.py and older restkv data do not record them); regenerate the file: {regenerate}"
        )
    type_needle_v = get_task(task).args["type_needle_v"]
    questions = []
    for needle in needles:
        text, prefix = niah_prompt(type_needle_v, needle["key"], len(needle["values"]), "")
        questions.append(Question(split_question(task, text)[1], prefix, {"outputs": needle["values"]}))
    return tuple(questions)


def score_dataset(dataset: str, records: Sequence[Mapping[str, Any]]) -> float:
    """A ``<length>/<task>`` dataset's RULER score over its prediction lines."""
    task = dataset.split("/")[-1]
    if task not in TASKS:
        raise DataError(f"{dataset}: not a RULER task; known: {', '.join(TASKS)}")
    predictions, references = [], []
    for number, record in enumerate(records, 1):
        gold = record.get("outputs", record.get("output"))
        if "pred" not in record or gold is None:
            raise DataError(f"{dataset} record {number}: needs 'pred' and 'outputs'")
        predictions.append(record["pred"])
        references.append([gold] if isinstance(gold, str) else gold)
    return score_task(task, predictions, references)


def check_flags(args: argparse.Namespace) -> None:
    """``--multi_question`` runs only tasks whose samples record their needles."""
    if args.multi_question:
        unsupported = [task for task in selected_datasets(args, BENCHMARK) if task not in MULTI_QUESTION_TASKS]
        if unsupported:
            raise FlagError(f"--multi_question asks about each inserted needle, so it runs only the niah tasks "
                            f"({', '.join(MULTI_QUESTION_TASKS)}); give --datasets without {', '.join(unsupported)}")


BENCHMARK = Benchmark(
    "ruler",
    datasets=tuple(TASKS),
    default_datasets=SYNTHETIC_TASKS,
    load_samples=ruler_samples,
    score=score_dataset,
    default_data_dir="data/RULER",
    prediction_flags=("chat_template", "multi_question"),
    prediction_glob="[0-9]*/*.jsonl",
    check_flags=check_flags,
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ruler")
    group.add_argument("--context_lengths", type=int, nargs="+", default=[4096],
                       help="sequence lengths to run (subfolders of --data_dir)")
    group.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=True,
                       help="wrap input in the tokenizer's chat template (the generator counts it by default)")
    group.add_argument("--multi_question", action="store_true",
                       help="niah tasks: compress each sample's context (its input before the question) once and "
                       "ask one question per inserted needle, in RULER's wording for that key, from that one "
                       "compressed context; one line per question (id <sample>/<needle>), each scored on its own "
                       "needle's values. Query-agnostic by definition (implies --query_agnostic); its folder is "
                       "<method>_<budget>[_<variant>...]_agnostic_multi[_<tag>]. Needs data from "
                       "restkv.benchmarks.ruler_data, which records the needles")


@command_line
def run(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    """``run_ruler.py``: parse flags, load and patch the model (unless given), run every task file."""
    return run_args(parse_args(BENCHMARK, argv, add_flags), model=model, tokenizer=tokenizer)


def run_args(args: argparse.Namespace, model=None, tokenizer=None) -> Path:
    """``run`` on flags already parsed and checked (the sweep builds its runs' flags itself)."""
    args = copy.copy(args)  # the caller's flags stay as given
    if args.model_max_len is None:  # RULER samples are built to fit their length: never cut them
        args.model_max_len = max(args.context_lengths)
    if args.multi_question:  # every question follows the context compressed alone, in a folder of its own
        args.query_agnostic = True
        args.tag = "_".join(part for part in (MULTI_QUESTION_TAG, args.tag) if part)
    tasks = selected_datasets(args, BENCHMARK)
    datasets = [f"{length}/{task}" for length in args.context_lengths for task in tasks]
    folder = runner.run(BENCHMARK, args, model=model, tokenizer=tokenizer, datasets=datasets)
    print(f"predictions in {folder}")
    return folder


# ----------------------------------------------------------------------------- evaluation


def length_scores(run: RunScores) -> dict[int, dict[str, float]]:
    """{length: {task: score}} of a run's scored datasets (``<length>/<task>``)."""
    scores: dict[int, dict[str, float]] = {}
    for name, score in run.datasets.items():
        if score.score is not None:
            length, task = name.split("/")
            scores.setdefault(int(length), {})[task] = score.score
    return scores


def run_table(run: RunScores) -> str:
    """A run's table (``score_table``) with the samples scored per length, incomplete cells
    marked, and its footnotes."""
    columns, rows = score_table(length_scores(run))
    for row in rows:
        lengths = {row["length"]} if row["length"] != "mean" else {name.split("/")[0] for name in run.datasets}
        in_row = {name: score for name, score in run.datasets.items() if name.split("/")[0] in lengths}
        for column in columns:
            if column in row:
                under = [score for name, score in in_row.items() if column == "Avg" or name.endswith(f"/{column}")]
                row[column] = marked(row[column], under)
        row["samples"] = samples_cell(in_row.values())
    return "\n".join([format_table(rows, [*columns, "samples"], first="length"),
                      *footnotes(run.label, run.datasets)])


@command_line
def evaluate(argv: Sequence[str] | None = None) -> dict[Path, dict[int, dict[str, float]]]:
    """``eval_ruler.py``: score every run folder under ``--results_dir``, print and write the tables."""
    parser = argparse.ArgumentParser(description="Score RULER predictions (RULER's string-match metrics).")
    parser.add_argument("--results_dir", required=True, help="a run_ruler.py run folder, or a folder above several")
    args = parser.parse_args(argv)
    results = {}
    for run in scoring.evaluate(BENCHMARK, args.results_dir):
        scores = length_scores(run)
        if scores:
            json_path, _ = write_scores(scores, run.folder)
            written = f"(written to {json_path} and .csv, and {run.folder / scoring.SCORES_FILE})"
        else:
            written = f"(no predictions yet; written to {run.folder / scoring.SCORES_FILE})"
        print(f"{run.folder}\n{run_table(run)}\n{written}\n")
        results[run.folder] = scores
    return results
