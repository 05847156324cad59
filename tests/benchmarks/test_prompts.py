"""Prompts: chat template, question split, answer prefix, middle truncation, stop tokens."""

from __future__ import annotations

import dataclasses

import pytest
from toy_benchmark import STORY, toy_samples

from restkv.benchmarks import prompts
from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.prompts import encode_prompt


def test_query_aware_prompt_is_the_chat_wrapped_text(tokenizer):
    """The opening, the context and the question with the closing, tokenised apart (the
    query-agnostic split's tokens, joined)."""
    sample = toy_samples(None, "logs", None)[0]
    encoded = encode_prompt(tokenizer, sample, max_tokens=4000)
    wrapped = tokenizer.apply_chat_template(
        [{"role": "user", "content": sample.context + sample.question}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.decode(encoded.context_ids) == wrapped
    agnostic = encode_prompt(tokenizer, sample, max_tokens=4000, split=True)
    assert encoded.context_ids == agnostic.context_ids + agnostic.question_ids
    assert encoded.question_ids == [] and not encoded.truncated
    start, stop = encoded.context_span
    assert (start, stop) == agnostic.context_span
    assert tokenizer.decode(encoded.context_ids[start:stop]) == sample.context
    assert tokenizer.decode(encoded.context_ids[:start]) == wrapped[: wrapped.index(sample.context)]
    assert tokenizer.decode(encoded.context_ids[stop:]).startswith(sample.question)


def test_query_agnostic_prompt_splits_before_the_question(tokenizer):
    sample = toy_samples(None, "logs", None)[0]
    aware = encode_prompt(tokenizer, sample, max_tokens=4000)
    agnostic = encode_prompt(tokenizer, sample, max_tokens=4000, split=True)
    context_text = tokenizer.decode(agnostic.context_ids)
    question_text = tokenizer.decode(agnostic.question_ids)
    assert "door code is 4000" in context_text and "Question" not in context_text
    assert question_text.startswith("Question: what is the door code?")
    assert question_text.endswith("<|im_start|>assistant\n")
    assert context_text + question_text == tokenizer.decode(aware.context_ids)


def test_raw_prompts_and_answer_prefix(tokenizer):
    sample = dataclasses.replace(toy_samples(None, "logs", None)[0], chat=False, answer_prefix=" The code is")
    text = sample.context + sample.question + sample.answer_prefix
    raw = encode_prompt(tokenizer, sample, 4000)
    assert raw.context_ids == tokenizer(sample.context).input_ids + tokenizer(
        sample.question + sample.answer_prefix, add_special_tokens=False).input_ids
    assert tokenizer.decode(raw.context_ids) == text
    assert tokenizer.decode(raw.context_ids[slice(*raw.context_span)]) == sample.context
    chat = dataclasses.replace(sample, chat=True)
    assert tokenizer.decode(encode_prompt(tokenizer, chat, 4000).context_ids).endswith("assistant\n The code is")
    split = encode_prompt(tokenizer, chat, 4000, split=True)
    assert tokenizer.decode(split.question_ids).endswith("assistant\n The code is")


def test_long_prompts_are_cut_in_the_middle(tokenizer):
    sample = toy_samples(None, "logs", None)[0]
    encoded = encode_prompt(tokenizer, dataclasses.replace(sample, chat=False), max_tokens=64)
    text = tokenizer.decode(encoded.context_ids)
    assert encoded.truncated and abs(encoded.num_tokens - 64) <= 2  # re-tokenising may merge at the cut
    assert text.startswith("Read the log.") and text.endswith(sample.question)
    assert "day 5 " not in text
    split = encode_prompt(tokenizer, sample, max_tokens=64, split=True)
    assert tokenizer.decode(split.question_ids).startswith(sample.question)


def test_a_limit_below_two_tokens_is_refused(tokenizer):
    """Half of 1 is 0 tokens, and ids[-0:] would have kept the whole prompt."""
    for limit in (1, 0, -4):
        with pytest.raises(ValueError, match="max_tokens must be >= 2"):
            prompts.truncate_middle(tokenizer, STORY, limit)
    head, tail, truncated = prompts.truncate_middle(tokenizer, STORY, 2)
    assert truncated and len(tokenizer(head + tail, add_special_tokens=False).input_ids) <= 3


def test_a_question_longer_than_the_kept_half_is_cut_with_the_context(tokenizer):
    long_question = "Question: " + STORY
    sample = Sample(id="x", context="Intro. " + STORY, question=long_question, max_new_tokens=1, chat=False)
    encoded = encode_prompt(tokenizer, sample, max_tokens=40, split=True)
    assert encoded.truncated and 0 < len(encoded.question_ids) <= 21


def test_stop_tokens_include_every_eos_and_extra_texts(tokenizer, tiny):
    tiny.generation_config.eos_token_id = [2, 7]
    try:
        assert prompts.stop_token_ids(tiny, tokenizer, ["\n"]) == [2, 7, 198]
    finally:
        tiny.generation_config.eos_token_id = 2
