"""Needle-in-a-Haystack: the grid, the haystack, needle insertion, the prompt and the scorer.

The protocol is the ReST-KV release's (itself from gkamradt's test via KVCache-Factory):

* grid: context lengths ``start, start + step, ..., <= end`` (the paper: 1000..32000 by 200)
  × depth percents ``round(linspace(0, 100, 10))``;
* context: the haystack's first ``length`` tokens, minus a 200-token buffer for the prompt and
  answer; if haystack + needle are too long the haystack is cut to ``buffer - needle``; at
  depth 100 the needle goes last, otherwise at ``int(len * depth / 100)`` moved back to just
  after a sentence-ending token (any token whose text ends with a period, found from the
  tokenizer instead of the release's hard-coded ids);
* prompt: the release's "long story book" wrapper, greedy decoding, at most 30 new tokens,
  stopping at EOS or a newline. The release sent it raw, starting with a literal
  ``<|im_start|>``; chat models such as SmolLM2 answer nothing to that (their first token is
  a newline), so by default the wrapper goes inside the chat template without that literal,
  and ``chat=False`` reproduces the release's raw prompt;
* score (no LLM judge): the share of the distinct lower-cased words of the expected answer
  "eat a sandwich and sit in Dolores Park on a sunny day." that appear among the response's
  whitespace-separated lower-cased words, in [0, 1] — the release's plotting scorer.

Haystack: the essays of ``--haystack_dir`` (a folder that must hold some), by default those in
``data/PaulGrahamEssays`` if present, else the project's synthetic prose
(:mod:`restkv.benchmarks.haystack`); the choice is recorded with the results.

``run`` is the command line of ``run_needle_in_haystack.py``; it scores the cells written so far
into ``needle_results.json`` (with the model, the mode and the whole config) and ``scores.json``
(``restkv.benchmarks.scoring``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from restkv.benchmarks import runner, scoring
from restkv.benchmarks.benchmark import Benchmark, Sample
from restkv.benchmarks.errors import DataError, FlagError, command_line
from restkv.benchmarks.flags import compression_config_from_args, parse_args
from restkv.benchmarks.haystack import ESSAY_DIR, HaystackText, given_essays, load_essays
from restkv.benchmarks.results import read_predictions

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
RETRIEVAL_QUESTION = "The best thing to do in San Francisco is: "
EXPECTED_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."
PROMPT_OPENING = "This is a very long story book: <book> "
RAW_PROMPT_START = "<|im_start|> "
PROMPT_QUESTION = " </book>.\n Based on the content of the book, Question: {question}\nAnswer:"
CONTEXT_BUFFER = 200
MAX_NEW_TOKENS = 30
SCORER = "word recall: |words(response) ∩ words(expected answer)| / |words(expected answer)|, lower-cased"


def context_lengths(start: int, end: int, step: int) -> list[int]:
    """``start, start + step, ...`` up to ``end`` inclusive (the release's ``np.arange(s, e + 1, step)``)."""
    if start < 1 or step < 1 or end < start:
        raise ValueError(f"context lengths need 1 <= --s_len <= --e_len and --step >= 1; got {start}, {end}, {step}")
    return list(range(start, end + 1, step))


def depth_percents(intervals: int = 10, minimum: float = 0, maximum: float = 100) -> list[int]:
    """``intervals`` evenly spaced depths from ``minimum`` to ``maximum``, rounded to integers."""
    if intervals < 1 or not 0 <= minimum <= maximum <= 100:
        raise ValueError(
            f"depths need intervals >= 1 and 0 <= min <= max <= 100; got {intervals}, {minimum}, {maximum}"
        )
    if intervals == 1:
        return [round(minimum)]
    return [round(minimum + (maximum - minimum) * i / (intervals - 1)) for i in range(intervals)]


def haystack_ids(tokenizer, haystack: HaystackText, min_tokens: int) -> list[int]:
    """Token ids of the haystack text, repeated until there are at least ``min_tokens``."""
    ids = tokenizer(haystack.text, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"the haystack {haystack.source} is empty")
    copies = 1
    while len(ids) < min_tokens:  # tokens merge across copies, so check after each try
        copies = max(copies + 1, -(-copies * min_tokens // len(ids)))
        ids = tokenizer(haystack.text * copies, add_special_tokens=False).input_ids
    return ids


class SentenceEnds:
    """Which token ids end a sentence (their text ends with a period), cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._known: dict[int, bool] = {}

    def __call__(self, token_id: int) -> bool:
        if token_id not in self._known:
            self._known[token_id] = self.tokenizer.decode([token_id]).strip().endswith(".")
        return self._known[token_id]


def insert_needle(
    haystack: Sequence[int],
    needle: Sequence[int],
    context_length: int,
    depth_percent: float,
    is_sentence_end,
    buffer: int = CONTEXT_BUFFER,
) -> list[int]:
    """The context's token ids: ``context_length - buffer`` tokens, the needle at ``depth_percent``."""
    budget = context_length - buffer
    if budget <= len(needle):
        raise ValueError(
            f"context length {context_length} leaves no room for the needle after the {buffer}-token buffer"
        )
    kept = list(haystack[: min(context_length, budget - len(needle))])
    if depth_percent >= 100:
        return kept + list(needle)
    point = int(len(kept) * depth_percent / 100)
    while point > 0 and not is_sentence_end(kept[point - 1]):
        point -= 1
    return kept[:point] + list(needle) + kept[point:]


@dataclass(frozen=True)
class NeedlePrompt:
    """One grid cell's prompt, split where the question starts (for query-agnostic runs)."""

    context_length: int
    depth_percent: int
    context: str
    question: str


def build_prompts(
    tokenizer,
    haystack: HaystackText,
    lengths: Iterable[int],
    depths: Iterable[int],
    needle: str = NEEDLE,
    question: str = RETRIEVAL_QUESTION,
    buffer: int = CONTEXT_BUFFER,
    chat: bool = True,
) -> list[NeedlePrompt]:
    """Every (length, depth) cell's prompt, lengths outer, depths inner (``chat=False``: the raw release prompt)."""
    lengths, depths = list(lengths), list(depths)
    ids = haystack_ids(tokenizer, haystack, max(lengths))
    needle_ids = tokenizer(needle, add_special_tokens=False).input_ids
    ends = SentenceEnds(tokenizer)
    opening = PROMPT_OPENING if chat else RAW_PROMPT_START + PROMPT_OPENING
    prompts = []
    for length in lengths:
        for depth in depths:
            context_ids = insert_needle(ids, needle_ids, length, depth, ends, buffer)
            text = tokenizer.decode(context_ids, skip_special_tokens=True)
            prompts.append(NeedlePrompt(length, depth, opening + text, PROMPT_QUESTION.format(question=question)))
    return prompts


def score_response(response: str, expected: str = EXPECTED_ANSWER) -> float:
    """Share of the expected answer's distinct lower-cased words found in the response (0..1)."""
    wanted = set(expected.lower().split())
    return len(set(response.lower().split()) & wanted) / len(wanted)


def score_records(records: Iterable[Mapping]) -> list[dict]:
    """Result rows ``{context_length, depth_percent, response, score}`` from prediction lines."""
    return [
        {
            "context_length": int(record["context_length"]),
            "depth_percent": int(record["depth_percent"]),
            "response": record["pred"],
            "score": score_response(record["pred"]),
        }
        for record in records
    ]


def write_results(rows: Sequence[Mapping], path: str | Path, **about) -> dict:
    """``needle_results.json``: the scorer, the mean score and one row per cell (plus ``about``)."""
    if not rows:
        raise ValueError("no needle results to write")
    results = {
        **about,
        "scorer": SCORER,
        "mean_score": round(statistics.fmean(row["score"] for row in rows), 4),
        "cells": list(rows),
    }
    path = Path(path)
    staging = path.with_name(f".{path.name}.{os.getpid()}")  # shards may finish at the same time
    staging.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(staging, path)
    return results


def read_results(path: str | Path) -> list[dict]:
    """The cells of a ``needle_results.json``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if "cells" not in data:
        raise ValueError(f"{path} is not a needle_results.json (no 'cells')")
    return data["cells"]


def score_grid(rows: Iterable[Mapping]) -> tuple[list[int], list[int], list[list[float | None]]]:
    """(depths, lengths, mean score per [depth][length], None where a cell has no result)."""
    cells: dict[tuple[int, int], list[float]] = {}
    for row in rows:
        cells.setdefault((int(row["depth_percent"]), int(row["context_length"])), []).append(float(row["score"]))
    depths = sorted({d for d, _ in cells})
    lengths = sorted({n for _, n in cells})
    grid = [[statistics.fmean(cells[(d, n)]) if (d, n) in cells else None for n in lengths] for d in depths]
    return depths, lengths, grid


# ----------------------------------------------------------------------------- running


def grid(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The flags' context lengths and depths; raises ``FlagError``."""
    try:
        return args.context_lengths or context_lengths(args.s_len, args.e_len, args.step), depth_percents(
            args.depth_intervals)
    except ValueError as error:
        raise FlagError(str(error)) from None


def check_flags(args: argparse.Namespace) -> None:
    """The grid, and a buffer that leaves every context length room for some haystack."""
    lengths, _ = grid(args)
    buffer = args.final_context_length_buffer
    if buffer < 0:
        raise FlagError(f"--final_context_length_buffer must be >= 0; got {buffer}")
    short = [str(length) for length in lengths if length <= buffer]
    if short:
        raise FlagError(f"--final_context_length_buffer {buffer} leaves no room for the haystack at context length "
                        f"{', '.join(short)}")


def load_haystack(folder: str | None, min_words: int) -> HaystackText:
    """The essays of ``--haystack_dir`` (``--data_dir``), which must hold some; without the flag,
    those of ``data/PaulGrahamEssays`` if present, else the project's synthetic prose."""
    if folder is None:
        return load_essays(ESSAY_DIR, min_words=min_words)
    return given_essays("--haystack_dir", folder)


def needle_samples(args: argparse.Namespace, dataset: str, tokenizer) -> list[Sample]:
    """One sample per (context length, depth) cell of the flags' grid, lengths outer."""
    lengths, depths = grid(args)
    haystack = load_haystack(args.data_dir, max(lengths))
    try:
        prompts = build_prompts(tokenizer, haystack, lengths, depths, buffer=args.final_context_length_buffer,
                                chat=args.chat_template)
    except ValueError as error:  # an empty haystack, a needle longer than a cell's room
        raise DataError(str(error)) from None
    return [
        Sample(
            id=f"len_{p.context_length}_depth_{p.depth_percent}",
            context=p.context,
            question=p.question,
            max_new_tokens=MAX_NEW_TOKENS,
            fields={"context_length": p.context_length, "depth_percent": p.depth_percent, "haystack": haystack.source},
            chat=args.chat_template,
            stop_tokens=("\n",),
        )
        for p in prompts
    ]


def score_dataset(dataset: str, records: Sequence[Mapping]) -> float:
    """The grid's mean word recall, as a percentage."""
    for number, record in enumerate(records, 1):
        if "pred" not in record:
            raise DataError(f"{dataset} record {number}: needs 'pred'")
    return round(100 * statistics.fmean(score_response(record["pred"]) for record in records), 2)


BENCHMARK = Benchmark(
    "needle",
    datasets=("needle",),
    default_datasets=("needle",),
    load_samples=needle_samples,
    score=score_dataset,
    default_data_dir=None,
    prediction_flags=("chat_template", "final_context_length_buffer"),
    check_flags=check_flags,
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("needle")
    group.add_argument("--s_len", type=int, default=1000, help="smallest context length (tokens)")
    group.add_argument("--e_len", type=int, default=8000, help="largest context length (tokens, inclusive)")
    group.add_argument("--step", type=int, default=1000, help="context length step")
    group.add_argument("--context_lengths", type=int, nargs="+", default=None,
                       help="explicit lengths (instead of s/e/step)")
    group.add_argument("--depth_intervals", type=int, default=10, help="number of depths from 0 to 100 percent")
    group.add_argument("--final_context_length_buffer", type=int, default=CONTEXT_BUFFER,
                       help="tokens of each length left for the prompt wrapper and the answer")
    group.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=True,
                       help="wrap the prompt in the tokenizer's chat template; --no-chat_template sends the "
                       "release's raw prompt")
    # The original release's needle runner spelled these differently from the other runners.
    group.add_argument("--haystack_dir", dest="data_dir", default=argparse.SUPPRESS,
                       help="alias of --data_dir: folder of *.txt essays (default: data/PaulGrahamEssays if "
                       "present, else the project's synthetic prose)")
    group.add_argument("--model_name", dest="model_path", default=argparse.SUPPRESS, help="alias of --model_path")
    group.add_argument("--max_capacity_prompt", dest="max_capacity_prompts", type=int, default=argparse.SUPPRESS,
                       help="alias of --max_capacity_prompts")


@command_line
def run(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> Path:
    """``run_needle_in_haystack.py``: run every cell not written yet, then score all written
    cells into ``needle_results.json`` beside the predictions."""
    args = parse_args(BENCHMARK, argv, add_flags)
    folder = runner.run(BENCHMARK, args, model=model, tokenizer=tokenizer)
    config = compression_config_from_args(args)
    rows = score_records(read_predictions(folder, "needle"))
    write_results(rows, folder / "needle_results.json", model=args.model_path, method=config.method,
                  budget=config.max_capacity_prompts, query_agnostic=bool(args.query_agnostic), config=config.to_dict())
    print(f"predictions in {folder}\n{scoring.runs_table([scoring.score_run(folder, BENCHMARK)])}")
    return folder
