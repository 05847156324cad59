"""Finch's question found from a delimiter token (--finch_delimiter): the token is taken out before the model
runs, the tokens after it are the window, and everything after the prompt continues at the positions of the
prompt without it; a prompt the delimiter cannot split is one ValueError naming the flag."""

import pytest
import torch
from tiny_models import greedy, left_padded, random_prompt, tiny_model

import restkv
import restkv.monkeypatch
from restkv import ConfigError
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache

DELIMITER = 2  # random_prompt never draws ids 0-2
OPTIONS = dict(method="finch", max_capacity_prompts=40)


def delimited(ids: torch.Tensor, question: int) -> torch.Tensor:
    """``ids`` with the delimiter before its last ``question`` tokens."""
    column = ids.shape[1] - question
    return torch.cat([ids[:, :column], torch.full((ids.shape[0], 1), DELIMITER), ids[:, column:]], dim=1)


def kept(cache) -> list:
    return [layer.exact for layer in kept_positions(cache)]


def test_generate_with_the_delimiter_is_generate_without_it_and_the_question_as_window():
    model, ids = tiny_model("llama"), random_prompt(1, 90)
    with restkv.compression(model, **OPTIONS, window_size=12):
        reference = greedy(model, ids)
    with restkv.compression(model, **OPTIONS, finch_delimiter=DELIMITER):
        ours = greedy(model, delimited(ids, 12))
    assert torch.equal(ours.sequences[:, 91:], reference.sequences[:, 90:])
    for mine, theirs in zip(ours.logits, reference.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert kept(output_cache(ours)) == kept(output_cache(reference))


def test_the_question_is_the_window_whatever_window_size_says():
    model, ids = tiny_model("llama"), random_prompt(1, 90)
    with restkv.compression(model, **OPTIONS, window_size=25):
        reference = restkv.prefill(model, ids)
    with restkv.compression(model, **OPTIONS, window_size=4, finch_delimiter=DELIMITER):
        cache = restkv.prefill(model, delimited(ids, 25))
        config = restkv.monkeypatch.config_of(model)
    assert kept(cache) == kept(reference) and cache.get_seq_length() == 90
    assert config.run.window_size == 4  # the model's config is back as it was after the prefill
    for mine, theirs in zip(cache.layers, reference.layers):
        assert torch.equal(mine.kept_tokens()[0], theirs.kept_tokens()[0])


def test_a_left_padded_batch_strips_each_rows_own_column():
    model = tiny_model("llama")
    ids, mask = left_padded([80, 64])
    with restkv.compression(model, **OPTIONS, window_size=10):
        reference = greedy(model, ids, mask)
    question = torch.cat([ids[:, :-10], torch.full((2, 1), DELIMITER), ids[:, -10:]], dim=1)
    question_mask = torch.cat([mask[:, :-10], torch.ones(2, 1, dtype=mask.dtype), mask[:, -10:]], dim=1)
    with restkv.compression(model, **OPTIONS, finch_delimiter=DELIMITER):
        ours = greedy(model, question, question_mask)
    assert torch.equal(ours.sequences[:, 81:], reference.sequences[:, 80:])
    assert kept(output_cache(ours)) == kept(output_cache(reference))


@pytest.mark.parametrize("ids, message", [
    (random_prompt(1, 60), "row 0 holds it 0 times"),
    (delimited(delimited(random_prompt(1, 60), 30), 10), "row 0 holds it 2 times"),
    (torch.cat([random_prompt(1, 60), torch.full((1, 1), DELIMITER)], dim=1), "nothing follows the delimiter"),
    (torch.cat([delimited(random_prompt(1, 60), 10), delimited(random_prompt(1, 60, seed=2), 11)]),
     r"the rows' questions differ in length \(\[10, 11\] tokens"),
])
def test_a_prompt_the_delimiter_cannot_split_is_one_error_naming_the_flag(ids, message):
    model = tiny_model("llama")
    with restkv.compression(model, **OPTIONS, finch_delimiter=DELIMITER), \
            pytest.raises(ValueError, match=f"^--finch_delimiter {DELIMITER}: .*{message}"):
        restkv.prefill(model, ids)


def test_a_question_longer_than_the_budget_names_the_flag():
    model = tiny_model("llama")
    with restkv.compression(model, **OPTIONS, finch_delimiter=DELIMITER), \
            pytest.raises(ConfigError, match="^--finch_delimiter 2: the question has 45 tokens, the window: "):
        restkv.prefill(model, delimited(random_prompt(1, 90), 45))


def test_the_delimiter_refuses_what_compresses_again_with_other_queries():
    with pytest.raises(ConfigError, match="--finch_delimiter 7 finds the question of one whole prompt; "
                                          "--prefill_chunk_size 32"):
        restkv.CompressionConfig(**OPTIONS, finch_delimiter=7, prefill_chunk_size=32)
    with pytest.raises(ConfigError, match="--finch_delimiter must be >= 0"):
        restkv.CompressionConfig(**OPTIONS, finch_delimiter=-1)
    assert restkv.CompressionConfig(**OPTIONS, finch_delimiter=7, window_size=0).policy.question_delimiter == 7


def test_query_agnostic_generation_refuses_a_context_that_holds_the_delimiter():
    model, ids = tiny_model("llama"), random_prompt(1, 60)
    with restkv.compression(model, **OPTIONS, finch_delimiter=DELIMITER), \
            pytest.raises(ValueError, match="^--finch_delimiter: the context held the question delimiter, but "
                                            "query-agnostic generation"):
        restkv.generate_after_context(model, delimited(ids, 10), random_prompt(1, 5), max_new_tokens=2)
