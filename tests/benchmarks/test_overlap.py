"""The n-gram overlap of an evaluation text with a training text (restkv.benchmarks.overlap), and the guard that the
learned scorers' training corpus shares (almost) nothing with the held-out types or the project's benchmark texts."""

import pytest

from restkv.benchmarks.heldout_text import HELD_OUT_TYPES, held_out_sequences
from restkv.benchmarks.overlap import benchmark_texts, ngram_overlap, token_overlap, word_overlap
from restkv.benchmarks.text import synthetic_prose
from restkv.learned.training_text import training_sequences

#: the sizes the shipped weights' report used (sequences of 2048 tokens)
SEQ_LEN = 2048


def test_the_share_counts_every_evaluation_ngram_position():
    assert ngram_overlap([[1, 2, 3, 4, 5]], [[0, 1, 2, 3, 9]], n=3) == pytest.approx(1 / 3)  # 123 of 123 234 345
    assert ngram_overlap([[1, 2, 3], [1, 2, 3]], [[1, 2, 3]], n=3) == 1.0
    assert ngram_overlap([[1, 2, 3, 4]], [[1, 2], [3, 4]], n=3) == 0.0  # no n-gram spans two training sequences
    assert ngram_overlap([[1, 2]], [[1, 2]], n=3) == 0.0  # an evaluation with no n-gram
    assert word_overlap(["The cat sat on the mat today"], ["the CAT sat on the mat"], n=5) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n >= 1"):
        ngram_overlap([[1]], [[1]], n=0)


@pytest.fixture(scope="module")
def training(tokenizer):
    ids = training_sequences(tokenizer, 8, SEQ_LEN, seed=0)
    return ids, [tokenizer.decode(sequence) for sequence in ids]


@pytest.mark.parametrize("text_type", HELD_OUT_TYPES)
def test_the_training_corpus_shares_almost_nothing_with_a_held_out_type(text_type, tokenizer, training):
    evaluation = held_out_sequences(tokenizer, text_type, 3, SEQ_LEN, seed=0)
    assert token_overlap(evaluation, training[0]) < 0.01
    assert word_overlap([tokenizer.decode(ids) for ids in evaluation], training[1]) < 0.01


def test_the_training_corpus_shares_almost_nothing_with_any_benchmark_text(tokenizer, training):
    texts = benchmark_texts(tokenizer)
    assert {"synthetic_prose", "ruler/niah_single_1", "ruler/niah_single_2", "ruler/vt", "needle"} <= set(texts)
    for name, text in texts.items():
        assert token_overlap([tokenizer(text, add_special_tokens=False).input_ids], training[0]) < 0.01, name
        assert word_overlap([text], training[1]) < 0.01, name


def test_the_measure_finds_the_overlap_the_old_training_text_had(tokenizer):
    """The learned scorer used to be fitted on the synthetic prose the essay haystacks are cut from: most of a
    RULER essay sample's n-grams were in it."""
    essay = benchmark_texts(tokenizer)["ruler/niah_single_2"]
    old_training = synthetic_prose(3 * SEQ_LEN)
    assert token_overlap([tokenizer(essay).input_ids], [tokenizer(old_training).input_ids]) > 0.5
    assert word_overlap([essay], [old_training]) > 0.5
