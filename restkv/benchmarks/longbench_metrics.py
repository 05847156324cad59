"""LongBench's per-sample metrics, reproducing the official scores exactly, quirks included.

Source of the definitions: THUDM/LongBench ``LongBench/metrics.py`` (the ReST-KV release
uses the same file). Each ``*_score`` metric is ``metric(prediction, ground_truth, **kwargs)
-> float`` in [0, 1]; ``restkv.benchmarks.longbench.scorer`` takes the best gold answer per
sample and averages. The quirks that move scores, kept on purpose so numbers stay
comparable with published ones:

* English normalisation deletes ASCII punctuation only and the words a/an/the;
* ``rouge_score`` is the ``rouge`` package's ROUGE-L F1; any exception scores 0, including
  the RecursionError its LCS back-tracking raises on one very long sentence (the official
  evaluation meets Python's default recursion limit at a fixed call depth; so do we);
* ``classification_score`` removes names from a list while iterating it, skipping the name
  after each removal;
* ``code_sim_score`` uses fuzzywuzzy's ``fuzz.ratio`` with its pure-difflib backend (what
  the official requirements install), reimplemented here so python-Levenshtein or
  rapidfuzz being installed cannot change a score.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
import sys
from collections import Counter
from typing import Sequence

#: The Chinese punctuation the official zh normalisation deletes (with ASCII punctuation).
CHINESE_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】"
    "〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ENGLISH_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + CHINESE_PUNCTUATION)


def _segment(text: str) -> list[str]:
    """jieba's accurate-mode words (the dictionary loads once, quietly)."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


# --------------------------------------------------------------------------- normalisation


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, replace the words a/an/the by spaces, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _ENGLISH_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation, delete all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


# --------------------------------------------------------------------------- QA F1


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of two token multisets; 0 when they share nothing (or either is empty)."""
    common = sum((Counter(prediction) & Counter(ground_truth)).values())
    if common == 0:
        return 0
    precision = 1.0 * common / len(prediction)
    recall = 1.0 * common / len(ground_truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    def words(text: str) -> list[str]:
        return [token for token in map(normalize_zh_answer, _segment(text)) if token]

    return f1_score(words(prediction), words(ground_truth))


# --------------------------------------------------------------------------- ROUGE-L

#: Nested Python calls that fit below the official ``rouge_score`` frame (eval.py ``<module>``
#: -> ``scorer`` -> ``rouge_score``, default limit 1000), measured with ``_recursion_room`` on
#: Python 3.11. With it, pred = gold = one sentence of 990 words scores 1 and of 991 words 0,
#: as in the official evaluation run as a script.
OFFICIAL_RECURSION_ROOM = 996


def _recursion_room() -> int:
    """How many nested Python calls still fit below the caller's frame."""
    depth = 0

    def dive() -> None:
        nonlocal depth
        depth += 1
        dive()

    try:
        dive()
    except RecursionError:
        pass
    return depth


def _rouge_l(prediction: str, ground_truth: str, room: int) -> float:
    """ROUGE-L F1, computed with room for exactly ``room`` nested calls below this frame whatever
    the caller's stack depth: a deep caller (a test runner, a notebook) would otherwise score
    long sentences 0 where the official run does not, and a raised limit the opposite."""
    from rouge import Rouge

    rouge = Rouge()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + room - _recursion_room())
    try:
        scores = rouge.get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official code scores any failure 0 (empty text, recursion)
        return 0.0
    finally:
        sys.setrecursionlimit(limit)
    return scores["rouge-l"]["f"]


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F1 of the ``rouge`` package (not ``rouge-score``); 0 on any error."""
    return _rouge_l(prediction, ground_truth, OFFICIAL_RECURSION_ROOM)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F1 over jieba words joined by spaces."""
    # Officially one frame deeper: rouge_zh_score calls rouge_score.
    return _rouge_l(" ".join(_segment(prediction)), " ".join(_segment(ground_truth)), OFFICIAL_RECURSION_ROOM - 1)


# --------------------------------------------------------------------------- classification, retrieval, count


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/k if the gold class is among the k class names found in the prediction, else 0.

    Names that are substrings of the gold label (but not equal to it) are removed while
    the list is walked; as in the official loop, the name right after a removed one is not
    examined.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    position = 0
    while position < len(matches):
        name = matches[position]
        if name in ground_truth and name != ground_truth:
            matches.remove(name)  # first occurrence, as list.remove does in the official loop
        position += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    """Share of the prediction's digit runs that equal ``target`` as strings (0 if none)."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return float(sum(number == target for number in numbers) / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_retrieval_en: gold id from ``Paragraph N``; digit runs equal to it / all digit runs."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_retrieval_zh: as ``retrieval_score`` with the gold id from ``段落N``."""
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_count: digit runs equal to the gold count / all digit runs."""
    return _fraction_equal(prediction, str(ground_truth))


# --------------------------------------------------------------------------- code


def fuzz_ratio(first: str, second: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` with the difflib backend: identical strings 100 (even empty),
    an empty one 0, else ``round(100 * SequenceMatcher.ratio())`` (with difflib's autojunk)."""
    if first == second:
        return 100
    if not first or not second:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, first, second).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Similarity of the first predicted line free of "`", "#" and "//" to the gold line."""
    candidates = prediction.lstrip("\n").split("\n")
    line = next((text for text in candidates if "`" not in text and "#" not in text and "//" not in text), "")
    return fuzz_ratio(line, ground_truth) / 100
