"""Held-out evaluation text (restkv.benchmarks.heldout_text): per type, a context of the asked size whose one fact
the question asks about, reproducible per sample, each type from its own seed space."""

import pytest

from restkv.benchmarks.heldout_text import HELD_OUT_TYPES, held_out_samples, held_out_sequences


def test_there_are_four_types_none_of_them_prose():
    assert HELD_OUT_TYPES == ("code", "records", "dialogue", "news")


@pytest.mark.parametrize("text_type", HELD_OUT_TYPES)
def test_a_sample_holds_its_answer_once_in_a_context_of_about_the_asked_size(text_type, tokenizer):
    samples = held_out_samples(text_type, tokenizer, 4, 500, seed=3)
    for sample in samples:
        assert sample.context.count(sample.answer) == 1 and sample.answer not in sample.question
        assert 500 <= len(tokenizer(sample.context, add_special_tokens=False).input_ids) < 700
        assert sample.question.endswith("?")
    assert len({sample.context for sample in samples}) == 4 and len({sample.answer for sample in samples}) == 4
    assert held_out_samples(text_type, tokenizer, 2, 500, seed=3) == samples[:2]  # whatever the count asked
    assert held_out_samples(text_type, tokenizer, 1, 500, seed=4) != samples[:1]


def test_the_fact_lies_at_varied_depths(tokenizer):
    depths = [sample.context.index(sample.answer) / len(sample.context)
              for sample in held_out_samples("records", tokenizer, 12, 400, seed=0)]
    assert min(depths) < 0.35 and max(depths) > 0.65


@pytest.mark.parametrize("text_type", HELD_OUT_TYPES)
def test_held_out_sequences_have_the_exact_length_and_are_not_the_samples(text_type, tokenizer):
    sequences = held_out_sequences(tokenizer, text_type, 2, 256, seed=0)
    assert [len(ids) for ids in sequences] == [256, 256] and sequences[0] != sequences[1]
    sample = tokenizer(held_out_samples(text_type, tokenizer, 1, 256, seed=0)[0].context,
                       add_special_tokens=False).input_ids
    assert sample[:256] != sequences[0]


def test_an_unknown_type_is_refused_with_the_choices(tokenizer):
    with pytest.raises(ValueError, match="unknown held-out text type 'poetry'; choose from code, records, dialogue"):
        held_out_samples("poetry", tokenizer, 1, 100, seed=0)
