"""How much of an evaluation text a training text already holds: the share of its n-grams found there.

A learned scorer's figures mean something only on text it was not fitted on. ``token_overlap`` is
the share of an evaluation text's token n-grams (``n = 8`` by default: long enough that a shared
word or number does not count, short enough that a shared phrase does) that occur anywhere in the
training text; ``word_overlap`` the same over lower-cased whitespace words (5-grams), which does not
depend on a tokenizer. Both count every n-gram position of the evaluation text, so a repeated
shared phrase weighs as often as it occurs. 0 means no shared n-gram; the trainers report both for
every held-out type and for the project's benchmark texts (``benchmark_texts``: the synthetic prose of
the essay haystacks, RULER's tasks with their noise and essay haystacks and needle templates, the
needle test's prompt), ``restkv.tools.train_scorer``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from restkv.benchmarks.haystack import load_essays
from restkv.benchmarks.needle import build_prompts
from restkv.benchmarks.ruler import SYNTHETIC_TASKS
from restkv.benchmarks.ruler_data import generate_task
from restkv.benchmarks.text import synthetic_prose

TOKEN_N = 8
WORD_N = 5
#: the size of each benchmark text ``benchmark_texts`` gives by default (the issue's contexts: about 2K tokens)
BENCHMARK_TOKENS = 2048


def _ngrams(items: Sequence, n: int) -> Iterable[tuple]:
    return (tuple(items[i : i + n]) for i in range(len(items) - n + 1))


def ngram_overlap(evaluation: Iterable[Sequence], training: Iterable[Sequence], n: int) -> float:
    """Share of the n-grams of the ``evaluation`` sequences (each read alone: no n-gram spans two)
    that occur in one of the ``training`` sequences; 0 for an evaluation with no n-gram."""
    if n < 1:
        raise ValueError(f"n-gram overlap needs n >= 1; got {n}")
    seen = {gram for sequence in training for gram in _ngrams(sequence, n)}
    total = shared = 0
    for sequence in evaluation:
        for gram in _ngrams(sequence, n):
            total += 1
            shared += gram in seen
    return shared / total if total else 0.0


def token_overlap(evaluation: Iterable[Sequence[int]], training: Iterable[Sequence[int]], n: int = TOKEN_N) -> float:
    """Share of the evaluation token lists' ``n``-grams found in the training token lists."""
    return ngram_overlap(evaluation, training, n)


def words(text: str) -> list[str]:
    """Lower-cased whitespace-separated words: what ``word_overlap`` compares."""
    return text.lower().split()


def word_overlap(evaluation: Iterable[str], training: Iterable[str], n: int = WORD_N) -> float:
    """Share of the evaluation texts' word ``n``-grams found in the training texts."""
    return ngram_overlap([words(text) for text in evaluation], [words(text) for text in training], n)


def benchmark_texts(tokenizer, context_tokens: int = BENCHMARK_TOKENS) -> dict[str, str]:
    """The texts the project's benchmarks generate, at about ``context_tokens`` tokens each: the synthetic prose
    (RULER's essay haystack and the needle test's, when no essays are given), one sample of every RULER synthetic
    task (their noise and essay haystacks, needle and question templates) and the needle test's prompt."""
    texts = {"synthetic_prose": synthetic_prose(context_tokens)}
    for task in SYNTHETIC_TASKS:
        texts[f"ruler/{task}"] = generate_task(task, context_tokens, 1, tokenizer, essay_dir=None)[0]["input"]
    prompt = build_prompts(tokenizer, load_essays(None, context_tokens), [context_tokens], [50])[0]
    texts["needle"] = prompt.context + prompt.question
    return texts
