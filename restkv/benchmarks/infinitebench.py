"""InfiniteBench: data files, prompts, generation lengths and the official per-task metrics.

Follows OpenBMB/InfiniteBench (``src/eval_utils.py``, ``src/prompt.py``,
``src/compute_scores.py``), as the ReST-KV release's runner does:

* data: ``<data_dir>/<task>.jsonl`` from the HF dataset ``xinrongzhang2022/InfiniteBench``,
  fields ``id, context, input, answer, options`` (``python -m restkv.data infinitebench`` fetches them);
* prompts: the ``yarn_mistral_templates`` (used for all open models), verbatim, no chat
  template; the runner middle-truncates the prompt to the model's limit (127000 tokens for
  Llama-3.1, as in the release);
* generation lengths: the official ones, or the release's (``passkey`` 15, ``number_string``
  20, ``kv_retrieval`` 80 new tokens);
* scores: the official ``compute_scores.py`` rules, a task's score being the mean × 100;
  ``longbook_sum_eng`` uses ROUGE-Lsum F1 as HF ``evaluate``'s rouge computes it (Google's
  ``rouge_score`` rules: lower-case alphanumeric tokens, no stemming, sentences split at
  newlines, summary-level union LCS), implemented here to avoid those dependencies.

``run`` and ``evaluate`` are the command lines of ``run_infinite_bench.py`` and ``eval_infinite.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from restkv.benchmarks import scoring
from restkv.benchmarks.benchmark import Benchmark, Sample
from restkv.benchmarks.errors import DataError, command_line
from restkv.benchmarks.longbench_metrics import f1_score, normalize_answer, normalize_zh_answer
from restkv.benchmarks.results import read_jsonl
from restkv.benchmarks.runner import main as run_main
from restkv.benchmarks.sources import INFINITEBENCH

OPTION_LETTERS = "ABCD"


# ----------------------------------------------------------------------------- metrics


def _first_int(prediction: str) -> str:
    for item in re.split("[^0-9]", prediction):
        if item:
            return item
    return ""


def _first_label(label: Any) -> Any:
    return label[0] if isinstance(label, list) else label


def score_retrieval_number(prediction: str, label: Any) -> float:
    """passkey, number_string: the first run of digits equals the label."""
    return float(_first_label(label) == _first_int(prediction))


def score_kv_retrieval(prediction: str, label: Any) -> float:
    """The label is one of the words after ``\\n : " ' . , ? ! { }`` become spaces."""
    for c in ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]:
        prediction = prediction.replace(c, " ")
    return float(_first_label(label) in prediction.split())


def score_code_run(prediction: str, label: Any) -> float:
    """The last word, as an integer, equals the label."""
    prediction = prediction.strip()
    for c in ["\n", ".", "`", "'", '"', ":"]:
        prediction = prediction.replace(c, " ")
    words = prediction.split()
    if not words:
        return 0.0
    try:
        return float(int(words[-1]) == _first_label(label))
    except ValueError:
        return 0.0


def _score_after_answer_phrase(prediction: str, phrases: Sequence[str], answers: Sequence[str]) -> float | None:
    """The official answer-phrase rule of code_debug and the choice tasks, None if no phrase occurs.

    Double spaces are collapsed; at the first of ``phrases`` found (in that order), 1.0 if the
    text from one character after it starts with one of ``answers``, else 0.0.
    """
    while "  " in prediction:
        prediction = prediction.replace("  ", " ")
    for phrase in phrases:
        index = prediction.find(phrase)
        if index == -1:
            continue
        if len(prediction) < index + len(phrase) + 1:
            return 0.0
        rest = prediction[index + len(phrase) + 1 :]
        return float(any(rest.startswith(s) for s in answers))
    return None


def score_code_debug(prediction: str, label: Sequence[str]) -> float:
    """``X.``/``X:`` first, else the text after an answer phrase starts with the letter or function."""
    prediction = prediction.strip()
    function_name, letter = label[0], label[1]
    if prediction[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        prediction = prediction.replace(c, " ")
    score = _score_after_answer_phrase(
        prediction, ("answer is:", "is:", "answer:", "correct option is:"), (letter, function_name)
    )
    return 0.0 if score is None else score


def score_math_find(prediction: str, label: Any) -> float:
    """The first number (``\\d+\\.\\d+|\\d+``) equals the label, compared as the label's type."""
    label = _first_label(label)
    found = re.search(r"\d+\.\d+|\d+", prediction)
    if found is None:
        return 0.0
    if isinstance(label, bool) or not isinstance(label, (int, float)):
        raise TypeError(f"math_find labels are int or float, got {type(label).__name__}")
    if isinstance(label, int):
        return float(int(found.group(0)) == label) if "." not in found.group(0) else 0.0
    return float(float(found.group(0)) == label)


def score_longdialogue(prediction: str, label: Any) -> float:
    """The gold name is one of the upper-cased words after punctuation becomes spaces."""
    prediction = prediction.strip()
    for c in ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]:
        prediction = prediction.replace(c, " ")
    return float(_first_label(label) in [word.upper() for word in prediction.split()])


def score_choice(prediction: str, label: Sequence[str]) -> float:
    """First character A-D; else exact; else after an answer phrase; else first standalone A-D."""
    prediction = prediction.strip()
    if not prediction:
        return 0.0
    if prediction[0] in OPTION_LETTERS:
        return float(prediction[0] in label)
    if prediction in label:
        return 1.0
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        prediction = prediction.replace(c, " ")
    score = _score_after_answer_phrase(prediction, ("answer is:", "answer:", "answer is", "option is"), label)
    if score is not None:
        return score
    for word in prediction.split():
        if word in OPTION_LETTERS:
            return float(word in label)
    return 0.0


def score_qa_english(prediction: str, label: Any) -> float:
    """Token F1 after SQuAD normalisation (LongBench's rules, shared), best over the gold answers."""
    answers = [label] if isinstance(label, str) else label
    return max(f1_score(normalize_answer(prediction).split(), normalize_answer(a).split()) for a in answers)


def score_qa_chinese(prediction: str, label: Any) -> float:
    """Character F1 after Chinese normalisation, best over the gold answers."""
    answers = [label] if isinstance(label, str) else label
    return max(f1_score(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(a))) for a in answers)


def score_math_calc(prediction: str, label: Sequence) -> float:
    """Length of the correct prefix of the predicted number list, over the label's length."""
    if isinstance(label[0], list):
        label = label[0]
    numbers = [int(item) for item in re.split("[^0-9]", prediction) if item]
    correct = 0
    for expected, predicted in zip(label, numbers):
        if expected != predicted:
            break
        correct += 1
    return correct / len(label)


def rouge_tokens(text: str) -> list[str]:
    """rouge_score's default tokenizer without stemming: lower-case alphanumeric runs."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _lcs_indices(reference: Sequence[str], candidate: Sequence[str]) -> list[int]:
    """Indices into ``reference`` of one longest common subsequence (rouge_score's backtrack)."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            if reference[i - 1] == candidate[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    indices, i, j = [], rows, cols
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            indices.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return indices[::-1]


def rouge_lsum_f1(prediction: str, reference: str) -> float:
    """Summary-level ROUGE-L F1 (ROUGE-Lsum) with sentences split at newlines."""
    ref_sents = [rouge_tokens(s) for s in reference.split("\n") if s]
    cand_sents = [rouge_tokens(s) for s in prediction.split("\n") if s]
    ref_total, cand_total = sum(map(len, ref_sents)), sum(map(len, cand_sents))
    if not ref_total or not cand_total:
        return 0.0
    ref_counts = Counter(t for s in ref_sents for t in s)
    cand_counts = Counter(t for s in cand_sents for t in s)
    hits = 0
    for sentence in ref_sents:
        union = sorted(set().union(*(_lcs_indices(sentence, c) for c in cand_sents)))
        for token in (sentence[i] for i in union):
            # Each token counts at most as often as it occurs on both sides.
            if ref_counts[token] > 0 and cand_counts[token] > 0:
                hits += 1
                ref_counts[token] -= 1
                cand_counts[token] -= 1
    precision, recall = hits / cand_total, hits / ref_total
    return 0.0 if hits == 0 else 2 * precision * recall / (precision + recall)


def score_summary(prediction: str, label: Any) -> float:
    return rouge_lsum_f1(prediction, _first_label(label))


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class InfiniteTask:
    """A task: its yarn-mistral template, generation lengths (official, release) and scorer."""

    name: str
    template: str
    max_new_tokens: int
    release_max_new_tokens: int
    scorer: Callable[[str, Any], float]


_TASK_LIST = [
    InfiniteTask(
        "passkey",
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",
        6, 15, score_retrieval_number,
    ),
    InfiniteTask(
        "number_string",
        "There is an important info hidden inside a lot of irrelevant text. Find it. "
        "I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
        12, 20, score_retrieval_number,
    ),
    InfiniteTask(
        "kv_retrieval",
        "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",
        50, 80, score_kv_retrieval,
    ),
    InfiniteTask("longbook_sum_eng", "Summarize the book below.\n\n{context}\n\nSummary:", 1200, 1200, score_summary),
    InfiniteTask(
        "longbook_choice_eng",
        "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\n"
        "C. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",
        40, 40, score_choice,
    ),
    InfiniteTask(
        "longbook_qa_eng",
        "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
        "Question: {question}\nAnswer:",
        40, 40, score_qa_english,
    ),
    InfiniteTask(
        "longbook_qa_chn",
        "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
        40, 40, score_qa_chinese,
    ),
    InfiniteTask(
        "longdialogue_qa_eng",
        'Below is a dialogue script where one random occurrence of a character name is replaced with "$$MASK$$", '
        "and you should try to guess who that character is.\n\n{context}\n\n"
        "The name that has been replaced with $$MASK$$ is likely",
        40, 40, score_longdialogue,
    ),
    InfiniteTask("math_find", "{prefix}\n\n{context}\n\n{input}", 3, 3, score_math_find),
    InfiniteTask(
        "math_calc",
        "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\n"
        "Expression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",
        30000, 30000, score_math_calc,
    ),
    InfiniteTask(
        "code_run",
        "There is a function called {func} in the following Python code.\n\n{context}\n\n"
        "Please compute the exact value of {func_call}. The value of {func_call} is",
        5, 5, score_code_run,
    ),
    InfiniteTask(
        "code_debug",
        "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes "
        "it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
        "The correct option is:",
        5, 5, score_code_debug,
    ),
]
TASKS = {task.name: task for task in _TASK_LIST}
CHOICE_TASKS = ("longbook_choice_eng", "code_debug")


def get_task(name: str) -> InfiniteTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown InfiniteBench task {name!r}; choose from {', '.join(TASKS)}") from None


def load_task(data_dir: str | Path, task: str) -> list[dict]:
    """The examples of ``<data_dir>/<task>.jsonl``; each needs ``context`` (or ``content``), ``input``, ``answer``."""
    get_task(task)
    path = Path(data_dir) / f"{task}.jsonl"
    if not path.is_file():
        raise INFINITEBENCH.missing(path)
    examples = []
    for number, example in read_jsonl(path):
        if "context" not in example and "content" in example:
            example["context"] = example.pop("content")
        missing = [f for f in ("context", "input", "answer") if f not in example]
        if task in CHOICE_TASKS and "options" not in example:
            missing.append("options")
        if missing:
            raise ValueError(f"{path}:{number}: missing field(s) {', '.join(missing)}")
        examples.append(example)
    return examples


def _template_fields(example: Mapping, task: str) -> dict[str, str]:
    """The values of a template's placeholders other than ``{context}`` (official create_prompt)."""
    fields = {"input": example["input"], "question": example["input"]}
    if task in CHOICE_TASKS:
        options = example["options"]
        if len(options) != 4:
            raise ValueError(f"{task} example {example.get('id')}: needs 4 options, got {len(options)}")
        fields.update({f"OPTION_{letter}": option for letter, option in zip(OPTION_LETTERS, options)})
    if task == "code_run":
        calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", example["input"])
        if not calls:
            raise ValueError(f"code_run example {example.get('id')}: no func_N(x) call in its input")
        fields.update(func_call=calls[0], func=calls[0].split("(")[0])
    if task == "math_find":
        target = re.findall(r"The .+ of", example["input"])
        if not target:
            raise ValueError(f"math_find example {example.get('id')}: no 'The ... of' in its input")
        fields["prefix"] = f"What is {target[0].lower()[:-3]} in the following list?"
    return fields


def build_prompt(example: Mapping, task: str) -> tuple[str, str]:
    """(context part, question part) of the official prompt; their concatenation is the prompt."""
    before, after = get_task(task).template.split("{context}")
    fields = _template_fields(example, task)
    return before.format(**fields) + example["context"], after.format(**fields)


def get_answer(example: Mapping, task: str) -> Any:
    """The label the scorer compares with: ``[option text, letter]`` for the choice tasks."""
    answer = example["answer"]
    if task not in CHOICE_TASKS:
        return answer
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in OPTION_LETTERS:
        return list(answer)
    text = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
    if not isinstance(text, str) or text not in example["options"]:
        raise ValueError(f"{task} example {example.get('id')}: answer {answer!r} is not one of its options")
    return [text, OPTION_LETTERS[example["options"].index(text)]]


def score_task(task: str, predictions: Sequence[str], labels: Sequence[Any]) -> float:
    """A task's score: the mean of its per-example scores × 100, rounded to 2 decimals."""
    scorer = get_task(task).scorer
    if not predictions:
        raise ValueError(f"{task}: no predictions to score")
    values = [scorer(p, label) for p, label in zip(predictions, labels, strict=True)]
    return round(100 * sum(values) / len(values), 2)


# ----------------------------------------------------------------------------- running


def infinite_samples(args: argparse.Namespace, task: str, tokenizer=None) -> list[Sample]:
    """The samples of ``task``: official prompt split at the question, official (or release) length."""
    try:
        examples = load_task(args.data_dir, task)
    except (ValueError, FileNotFoundError) as error:
        raise DataError(str(error)) from None
    spec = get_task(task)
    max_new_tokens = spec.release_max_new_tokens if args.generation_lengths == "release" else spec.max_new_tokens
    samples = []
    for position, example in enumerate(examples):
        context, question = build_prompt(example, task)
        samples.append(
            Sample(
                id=str(example.get("id", position)),
                context=context,
                question=question,
                max_new_tokens=max_new_tokens,
                fields={"ground_truth": get_answer(example, task), "dataset": task},
                chat=args.chat_template,
            )
        )
    return samples


def score_dataset(task: str, records: Sequence[Mapping[str, Any]]) -> float:
    """A task's official score over its prediction lines."""
    if task not in TASKS:
        raise DataError(f"{task}: not an InfiniteBench task; known: {', '.join(TASKS)}")
    for number, record in enumerate(records, 1):
        if "pred" not in record or "ground_truth" not in record:
            raise DataError(f"{task} record {number}: needs 'pred' and 'ground_truth'")
    return score_task(task, [r["pred"] for r in records], [r["ground_truth"] for r in records])


BENCHMARK = Benchmark(
    "infinite_bench",
    datasets=tuple(TASKS),
    default_datasets=tuple(TASKS),
    load_samples=infinite_samples,
    score=score_dataset,
    default_data_dir="data/InfiniteBench",
    prediction_flags=("chat_template", "generation_lengths"),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("infinite_bench")
    group.add_argument("--generation_lengths", choices=["official", "release"], default="official",
                       help="new tokens per task: InfiniteBench's, or the ReST-KV release's (passkey 15, "
                       "number_string 20, kv_retrieval 80)")
    group.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=False,
                       help="wrap prompts in the tokenizer's chat template (official and release: no)")


def run(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    """``run_infinite_bench.py``: parse flags, load and patch the model (unless given), run every task."""
    return run_main(BENCHMARK, argv, add_flags, model=model, tokenizer=tokenizer)


# ----------------------------------------------------------------------------- evaluation


@command_line
def evaluate(argv: Sequence[str] | None = None) -> dict[Path, dict[str, float]]:
    """``eval_infinite.py``: score every run folder under ``--results_dir``, write
    ``infinite_scores.json`` ({task: score, "Avg": mean}) / ``.csv`` in each, print one table row per run."""
    parser = argparse.ArgumentParser(description="Score InfiniteBench predictions (official metrics).")
    parser.add_argument("--results_dir", required=True, help="a run_infinite_bench.py run folder, or a folder above")
    args = parser.parse_args(argv)
    runs = scoring.evaluate(BENCHMARK, args.results_dir)
    results = {}
    for run in runs:
        scores = {task: score.score for task, score in run.datasets.items() if score.score is not None}
        if scores:
            scores["Avg"] = run.average
        (run.folder / "infinite_scores.json").write_text(json.dumps(scores, indent=2) + "\n", encoding="utf-8")
        with open(run.folder / "infinite_scores.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(scores))
            writer.writeheader()
            writer.writerow(scores)
        results[run.folder] = scores
    print(scoring.runs_table(runs, [t for t in TASKS if any(t in run.datasets for run in runs)], average="Avg"))
    return results
