"""LongBench metrics against scores of THUDM/LongBench's own metrics.py and eval.py.

Every expected value below was computed by running the official evaluation code on the same
inputs (Python 3.11, rouge 1.0.1, jieba 0.42.1, fuzzywuzzy 0.18.0 without python-Levenshtein).
"""

from __future__ import annotations

import difflib
import math
import sys

import pytest

from restkv.benchmarks import longbench, longbench_metrics as metrics
from restkv.benchmarks.longbench import scorer, scorer_e

TREC_LIKE = ["Food", "Date", "Other"]
AUTOJUNK_PRED = "a" * 150 + "b" * 100 + "c" * 50
AUTOJUNK_GOLD = "a" * 150 + "c" * 50 + "b" * 100

OFFICIAL_SCORES = [
    # English QA F1: ASCII punctuation deleted, a/an/the dropped, nothing else.
    ("qa_f1_score", "The U.S.A.", "USA", None, 1.0),
    ("qa_f1_score", "1,000 people", "1000", None, 0.6666666666666666),
    ("qa_f1_score", "a well-known author", "well known author", None, 0.4),
    ("qa_f1_score", "Don't stop", "dont stop", None, 1.0),
    ("qa_f1_score", "\u201cParis\u201d", "Paris", None, 0),  # curly quotes survive normalisation
    ("qa_f1_score", "", "Paris", None, 0),
    ("qa_f1_score", "The cat sat on the mat", "cat on mat", None, 0.8571428571428571),
    ("qa_f1_score", "Paris\nFrance is the answer", "Paris", None, 0.4),  # multi-line scored whole
    # Chinese QA F1 over jieba words.
    ("qa_f1_zh_score", "北京是中国的首都。", "北京", None, 0.33333333333333337),
    ("qa_f1_zh_score", "答案：上海市", "上海", None, 0),
    ("qa_f1_zh_score", "他在2019年去了北京和上海", "北京、上海", None, 0.3636363636363636),
    # ROUGE-L of the `rouge` package; failures score 0.
    ("rouge_score", "The committee approved the budget.", "The budget was approved by the committee.", None,
     0.499999995138889),
    ("rouge_score", "The plan was delayed. Costs rose sharply.\nThe board resigned.",
     "Costs rose. The plan was delayed and the board resigned.", None, 0.8421052581717452),
    ("rouge_score", "", "x", None, 0.0),
    ("rouge_score", "...", "budget", None, 0.0),
    ("rouge_zh_score", "会议讨论了预算问题。", "会议主要讨论预算。", None, 0.7272727223140496),
    # Classification, with the remove-while-iterating quirk.
    ("classification_score", "Other location", "Other location", ["Other", "location", "Other location"], 0.5),
    ("classification_score", "Food", "Food", TREC_LIKE, 1.0),
    ("classification_score", "Food or Date", "Food", TREC_LIKE, 0.5),
    ("classification_score", "Date", "Food", TREC_LIKE, 0.0),
    # "Paragraph N" retrieval: fraction of digit runs equal to N, as strings.
    ("retrieval_score", "12", "Paragraph 12", None, 1.0),
    ("retrieval_score", "Paragraph 12", "Paragraph 12", None, 1.0),
    ("retrieval_score", "Paragraphs 12 and 13", "Paragraph 12", None, 0.5),
    ("retrieval_score", "Paragraph 012", "Paragraph 12", None, 0.0),
    ("retrieval_score", "Paragraph \uff11\uff12", "Paragraph 12", None, 0.0),  # full-width digits
    ("retrieval_score", "none", "Paragraph 12", None, 0.0),
    ("retrieval_zh_score", "段落3", "段落3", None, 1.0),
    ("retrieval_zh_score", "答案是段落3和段落4", "段落3", None, 0.5),
    # Counts.
    ("count_score", "5", 5, None, 1.0),
    ("count_score", "5.0", 5, None, 0.5),
    ("count_score", "05", 5, None, 0.0),
    ("count_score", "There are 5 unique paragraphs out of 7", "5", None, 0.5),
    # Code: first line free of ` # //, fuzz.ratio with the difflib backend.
    ("code_sim_score", "    return x + 1\n", "    return x + 1", None, 1.0),
    ("code_sim_score", "```python\n    return x\n```", "    return x", None, 1.0),
    ("code_sim_score", "# comment\nx = a // 2\ny = 3", "y = 3", None, 1.0),
    ("code_sim_score", "\n\nprint('#')\nfoo(bar)", "foo(baz)", None, 0.88),
    ("code_sim_score", "", "x = 1", None, 0.0),
    ("code_sim_score", "self.assertEqual(result.status_code, 200)",
     "        self.assertEqual(response.status_code, 200)", None, 0.83),
    ("code_sim_score", AUTOJUNK_PRED, AUTOJUNK_GOLD, None, 0.5),  # difflib's autojunk (>= 200 chars)
]


@pytest.mark.parametrize("name, prediction, gold, all_classes, expected", OFFICIAL_SCORES)
def test_metric_equals_the_official_score(name, prediction, gold, all_classes, expected):
    score = getattr(metrics, name)(prediction, gold, all_classes=all_classes)
    assert score == expected


def test_code_similarity_uses_the_difflib_backend():
    """The autojunk case separates difflib from an exact ratio (python-Levenshtein, rapidfuzz)."""
    exact = round(100 * difflib.SequenceMatcher(None, AUTOJUNK_PRED, AUTOJUNK_GOLD, autojunk=False).ratio())
    assert metrics.fuzz_ratio(AUTOJUNK_PRED, AUTOJUNK_GOLD) == 50 != exact


def test_fuzz_ratio_matches_fuzzywuzzy():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    lines = ["", "x", "    return self.items.pop()", "return items.pop()", "for i in range(10):", "é ü",
             AUTOJUNK_PRED, AUTOJUNK_GOLD, "int x = a / b;", "print('done')"]
    for first in lines:
        for second in lines:
            assert metrics.fuzz_ratio(first, second) == fuzz.ratio(first, second), (first, second)


def _nested(depth, function, *args):
    return function(*args) if depth == 0 else _nested(depth - 1, function, *args)


@pytest.mark.parametrize("depth", [0, 300])
def test_rouge_fails_on_the_same_long_sentences_as_the_official_run(depth):
    """One sentence of 991 words exceeds the official recursion room (score 0), 990 does not."""
    words = [f"w{i}" for i in range(991)]
    fits, too_long = " ".join(words[:990]), " ".join(words)
    limit = sys.getrecursionlimit()
    assert _nested(depth, metrics.rouge_score, fits, fits) == pytest.approx(1.0)
    assert _nested(depth, metrics.rouge_score, too_long, too_long) == 0.0
    assert sys.getrecursionlimit() == limit


def test_chinese_rouge_has_one_frame_less_room():
    """Officially rouge_zh_score calls rouge_score; 329 of these words still score, 330 do not."""
    base = "北京上海广州深圳天津重庆南京杭州武汉成都西安苏州"
    text = "".join(f"{base[i % len(base)]}{i}的" for i in range(330))
    fits = text[: text.index("329")]  # the first 329 words
    assert metrics.rouge_zh_score(fits, fits) > 0.99
    assert metrics.rouge_zh_score(text, text) == 0.0


def test_dataset_metrics_are_the_official_map():
    assert set(longbench.DATASET_METRIC) == set(longbench.DATASETS)
    assert longbench.DATASET_METRIC["multifieldqa_zh"] is metrics.qa_f1_zh_score
    assert longbench.DATASET_METRIC["dureader"] is metrics.rouge_zh_score
    assert longbench.DATASET_METRIC["passage_count"] is metrics.count_score
    code = {name for name, metric in longbench.DATASET_METRIC.items() if metric is metrics.code_sim_score}
    assert code == {"lcc", "repobench-p"}


@pytest.mark.parametrize(
    "dataset, predictions, answers, all_classes, expected",
    [
        # First-line rule (trec, triviaqa, samsum, lsht): leading newlines dropped, first line kept.
        ("trec", ["Food\nDate", "\n\nDate\nFood", " Food"], [["Food"], ["Date"], ["Food"]], TREC_LIKE, 100.0),
        ("samsum", ["\n\nAmy will bring the cake.\nTom agrees.", "Tom is late."],
         [["Amy brings the cake."], ["Tom is late again."]], None, 76.19),
        # No cut elsewhere; best gold answer per sample.
        ("narrativeqa", ["Paris\nFrance", "the king", "no idea"],
         [["Paris", "Paris, France"], ["The old king", "king"], ["London"]], None, 66.67),
        ("passage_count", ["5", "5.0", "There are 3"], [["5"], ["5"], ["4"]], None, 50.0),
        ("narrativeqa", ["cat", "dog", "cat dog"], [["cat"], ["cat"], ["cat"]], None, 55.56),
    ],
)
def test_scorer_equals_the_official_eval(dataset, predictions, answers, all_classes, expected):
    assert scorer(dataset, predictions, answers, all_classes) == expected


def test_scorer_e_buckets_by_length():
    scores = scorer_e("hotpotqa", ["Paris", "London", "Rome", "Paris"], [["Paris"], ["Paris"], ["Rome"], ["Rome"]],
                      [3999, 4000, 7999, 8000], None)
    assert scores == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0}
    empty = scorer_e("hotpotqa", ["Paris", "London"], [["Paris"], ["Paris"]], [10, 20], None)
    assert empty["0-4k"] == 50.0 and math.isnan(empty["4-8k"]) and math.isnan(empty["8k+"])
    assert list(empty) == ["0-4k", "4-8k", "8k+"]


def test_longbench_e_files_score_with_their_base_metric():
    assert scorer("trec_e", ["Food\nDate"], [["Food"]], TREC_LIKE) == 100.0
    with pytest.raises(ValueError, match="unknown LongBench dataset 'narrativeqa_e'"):
        scorer("narrativeqa_e", ["x"], [["x"]], None)
