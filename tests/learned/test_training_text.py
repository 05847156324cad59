"""The learned scorers' training corpus (restkv.learned.training_text): exact lengths, reproducible per sequence,
facts to copy (that it shares nothing with what it is judged on: tests/benchmarks/test_overlap.py)."""

import random
import re

from restkv.learned.training_text import training_sequences, training_text


def test_sequences_have_the_asked_length_and_each_is_the_same_whatever_the_count(tokenizer):
    three = training_sequences(tokenizer, 3, 300, seed=0)
    assert [len(ids) for ids in three] == [300, 300, 300] and len({tuple(ids) for ids in three}) == 3
    assert training_sequences(tokenizer, 1, 300, seed=0) == three[:1]
    assert training_sequences(tokenizer, 1, 300, seed=1) != three[:1]  # the seed picks other sequences


def test_the_text_weaves_in_codes_quantities_and_dates(tokenizer):
    text = training_text(3000, random.Random(5))
    assert len(text.split()) >= 3000
    assert re.search(r"\b[A-Z]{2}-\d{3,4}\b|\b\d[A-Z]\d-\d\d\b|\b[A-Z]\d\d/[A-Z]{2}\b", text)  # a code
    assert re.search(r"\b\d{1,3},\d{3}\b", text) and re.search(r"\b1[2-9]\d\d\b|\b20[0-5]\d\b", text)

