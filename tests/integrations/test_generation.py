"""Query-aware and query-agnostic compression through the same patched model."""

import pytest
import torch
from tiny_models import left_padded, random_prompt, replace_for, tiny_model

from restkv.cache import CompressedLayer, new_token_columns
from restkv.cache.partial import Probe
from restkv.integrations.transformers.generation import answer_many, answer_nll, generate_after_context
from restkv.integrations.transformers.steps import key_validity

GENERATE = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)


def test_query_agnostic_with_a_large_budget_equals_plain_generation():
    model = tiny_model("llama")
    context, question = random_prompt(1, 70, seed=1), random_prompt(1, 6, seed=2)
    reference = model.generate(torch.cat([context, question], dim=-1), **GENERATE)[:, 76:]
    replace_for("llama")(method="snapkv", max_capacity_prompts=100, window_size=8)
    assert torch.equal(generate_after_context(model, context, question, **GENERATE), reference)


def test_question_chunk_attends_to_the_compressed_context_and_nothing_is_compressed_again():
    model = tiny_model("mistral")
    context, question = random_prompt(1, 90, seed=1), random_prompt(1, 7, seed=2)
    replace_for("mistral")(method="snapkv", max_capacity_prompts=30, window_size=8)
    tokens, cache = generate_after_context(model, context, question, return_cache=True, **GENERATE)
    for layer in cache.layers:
        assert isinstance(layer, CompressedLayer)
        assert layer.prompt_tokens == 90  # compressed once, on the context alone
        assert layer.kept_counts.tolist() == [[30, 30]]
        assert layer.tail_length == 7 + 4  # the question and the generated tokens, exact
    aware = model.generate(torch.cat([context, question], dim=-1), **GENERATE)[:, 97:]
    assert tokens.shape == aware.shape  # both modes run through the same API


def test_query_agnostic_rows_of_a_padded_batch_equal_their_single_runs():
    model = tiny_model("qwen2")
    replace_for("qwen2")(method="h2o", max_capacity_prompts=24, window_size=8)
    context, context_mask = left_padded([80, 50, 33], seed=3)
    question, question_mask = left_padded([6, 3, 5], seed=9)
    batched = generate_after_context(model, context, question, context_mask, question_mask, **GENERATE)
    for row in range(3):
        alone = generate_after_context(
            model, context[row : row + 1, context_mask[row].bool()], question[row : row + 1, question_mask[row].bool()], **GENERATE
        )
        assert torch.equal(batched[row], alone[0])


def test_prefill_padding_is_read_from_every_mask_form():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    boolean = causal[None, None] & valid[:, None, None, :]
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~boolean, torch.finfo(torch.float32).min)
    for mask in (boolean, additive, valid.long()):  # sdpa, eager, flash_attention_2 (2-D)
        assert torch.equal(key_validity(mask, 2, 5, "cpu"), valid)
    assert bool(key_validity(None, 2, 5, "cpu").all())


def test_new_tokens_are_causal_within_the_chunk_and_padding_is_never_seen():
    # A chunk of 3 tokens at columns 3..5 (the middle one is padding in row 1), after 3 earlier ones.
    padding_2d = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1]])
    columns = new_token_columns(padding_2d, batch=2, first=3, count=3, device="cpu")
    assert columns.tolist() == [[3, 4, 5], [3, -1, 5]]
    four_d = padding_2d[:, None, None, :].bool().expand(2, 1, 3, 6) & \
        (torch.arange(6)[None, :] <= torch.arange(3, 6)[:, None])[None, None]
    assert torch.equal(new_token_columns(four_d, 2, 3, 3, "cpu"), columns)
    eager = torch.zeros(four_d.shape).masked_fill(~four_d, torch.finfo(torch.float32).min)
    assert torch.equal(new_token_columns(eager, 2, 3, 3, "cpu"), columns)
    assert new_token_columns(None, 1, 3, 3, "cpu") is None  # every token real: columns 3, 4, 5
    assert new_token_columns(torch.ones(1, 6), 1, 3, 3, "cpu") is None
    held = torch.cat([torch.arange(3).expand(2, -1).to(torch.int32), columns], dim=1)[:, None]  # [B, 1, 6]
    probe = Probe(torch.zeros(2, 1, 3, 4), 1, 3, 1.0)
    visible = probe.visibility(held)[:, 0]
    assert visible[0].tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False], [True] * 6]
    assert visible[1].tolist() == [[True] * 4 + [False] * 2, [True] * 4 + [False] * 2, [True] * 4 + [False, True]]


def test_answer_nll_with_a_large_budget_equals_the_unpatched_model():
    model = tiny_model("llama")
    context, question, answer = random_prompt(1, 60, seed=1), random_prompt(1, 5, seed=2), random_prompt(1, 4, seed=3)
    full = torch.cat([context, question, answer], dim=-1)
    logits = model(full).logits[0, 64:-1].float()
    reference = torch.nn.functional.cross_entropy(logits, answer[0], reduction="none")
    replace_for("llama")(method="snapkv", max_capacity_prompts=100, window_size=8)
    aware = answer_nll(model, torch.cat([context, question], dim=-1), answer)
    agnostic = answer_nll(model, context, answer, question_ids=question)
    torch.testing.assert_close(aware, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(agnostic, reference, rtol=1e-4, atol=1e-4)


def test_answer_nll_sees_the_compression():
    model = tiny_model("qwen2")
    context, answer = random_prompt(1, 90, seed=4), random_prompt(1, 3, seed=5)
    replace_for("qwen2")(method="snapkv", max_capacity_prompts=100, window_size=8)
    full = answer_nll(model, context, answer)
    replace_for("qwen2")(method="streamingllm", max_capacity_prompts=20, window_size=8)
    compressed = answer_nll(model, context, answer)
    assert compressed.shape == full.shape == (3,)
    assert not torch.allclose(compressed, full)


def test_an_empty_prompt_or_context_is_a_clear_error():
    from restkv.integrations.transformers.generation import answer_nll, generate_after_context, prefill

    model = tiny_model("llama")
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="the prompt is empty"):
        prefill(model, empty)
    with pytest.raises(ValueError, match="the context is empty"):
        generate_after_context(model, empty, random_prompt(1, 5), max_new_tokens=1)
    with pytest.raises(ValueError, match="the prompt is empty"):
        answer_nll(model, empty, random_prompt(1, 2))


@pytest.mark.parametrize("call, message", [
    (lambda model, ctx, q: generate_after_context(model, ctx, torch.zeros(1, 0, dtype=torch.long)),
     "the question is empty"),
    (lambda model, ctx, q: answer_many(model, ctx, [q, torch.zeros(1, 0, dtype=torch.long)]),
     "question 1 is empty"),
    (lambda model, ctx, q: answer_many(model, ctx, [random_prompt(2, 5)]),
     r"question 0 has 2 rows \(input ids of shape \[2, 5\]\); the context has 1"),
    (lambda model, ctx, q: generate_after_context(model, ctx, q[0]),
     r"the question must be 2-D \[batch, tokens\]; got input ids of shape \[5\]"),
    (lambda model, ctx, q: answer_many(model, ctx, [q], question_masks=[torch.ones(1, 3, dtype=torch.long)]),
     r"question 0's mask has shape \[1, 3\]; its input ids have \[1, 5\]"),
    (lambda model, ctx, q: generate_after_context(model, ctx, q, context_mask=torch.ones(1, 10, dtype=torch.long)),
     r"the context's mask has shape \[1, 10\]; its input ids have \[1, 40\]"),
    (lambda model, ctx, q: answer_many(model, ctx, [q, q], question_masks=[None]),
     "2 questions but 1 question masks"),
    (lambda model, ctx, q: answer_many(model, ctx, []), "answer_many needs at least one question"),
])
def test_bad_questions_are_refused_before_the_context_is_prefilled(call, message, prefill_calls):
    """A question that cannot follow the context (empty, another batch size, a mask of another
    length, a 1-D tensor) is a clear ValueError, raised before anything runs; an empty question
    once fed the whole context through the cache a second time."""
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=8)
    with pytest.raises(ValueError, match=message):
        call(model, random_prompt(1, 40), random_prompt(1, 5, seed=2))
    assert not prefill_calls


@pytest.mark.parametrize("options", [
    dict(method="snapkv", quant_method="kivi", nbits=4, quant_group_size=16, quant_residual_length=16),
    dict(method="think", recent_size=8, quant_method="kivi", nbits=4, quant_group_size=4, quant_residual_length=4),
    dict(method="think", recent_size=8, quant_method="kivi", nbits=4, quant_group_size=8, quant_residual_length=8),
    dict(method="snapkv", quant_method="kivi", nbits=2, quant_group_size=4, quant_residual_length=4),
    dict(method="snapkv", residual=True, quant_method="kivi", nbits=4, quant_group_size=8, quant_residual_length=8),
], ids=["kivi16", "think+kivi4", "think+kivi8", "kivi2-group4", "residual+kivi8"])
def test_answer_many_restores_quantised_layers_that_sealed_blocks_during_an_answer(options):
    """Issue 20: a question plus its answer (9 + 12 tokens) seals quantised blocks; the snapshots
    once shared the list of blocks, so the next question failed (TypeError, size mismatches).
    Each answer equals the question answered alone."""
    model = tiny_model("llama")
    context, questions = random_prompt(1, 120), [random_prompt(1, 9, seed=seed) for seed in (3, 4, 5)]
    replace_for("llama")(max_capacity_prompts=40, window_size=4, **options)
    settings = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    together = answer_many(model, context, questions, **settings)
    for answer, question in zip(together, questions):
        assert torch.equal(answer, generate_after_context(model, context, question, **settings))


@pytest.mark.parametrize("budget", [100, 32])
def test_beam_search_and_several_sequences_run_after_a_compressed_context(budget):
    """generate repeats the inputs it is given for beams and returned sequences, not a cache handed to it:
    the context's rows are repeated the same way (a shape error before). At a budget above the prompt,
    beam search equals the plain model's."""
    model = tiny_model("llama")
    context, question = random_prompt(1, 70, seed=1), random_prompt(1, 6, seed=2)
    beams = dict(max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    reference = model.generate(torch.cat([context, question], dim=-1), **beams)[:, 76:]
    replace_for("llama")(method="snapkv", max_capacity_prompts=budget, window_size=8)
    answer = generate_after_context(model, context, question, **beams)
    assert answer.shape == (1, 4)
    if budget > 76:
        assert torch.equal(answer, reference)
    torch.manual_seed(0)
    sampled = generate_after_context(model, context, question, max_new_tokens=3, do_sample=True,
                                     num_return_sequences=2, pad_token_id=0)
    assert sampled.shape == (2, 3)
    many = answer_many(model, context, [question, question[:, :3]], **beams)
    assert torch.equal(many[0], answer) and many[1].shape == (1, 4)


@pytest.mark.parametrize("span, message", [
    ((10, 500), r"context_span \(10, 500\) ends after the prompt's 120 tokens"),
    (("a", "b"), r"context_span must be a pair of integer token positions \(start, stop\); got \('a', 'b'\)"),
    ((10,), r"context_span must be a pair \(start, stop\) of token positions; got \(10,\)"),
    ((30, 10), r"context_span \(30, 10\) must be \(start, stop\) with 0 <= start < stop"),
])
def test_a_context_span_outside_the_prompt_or_malformed_is_refused_naming_it(span, message):
    from restkv.integrations.transformers.generation import prefill

    model = tiny_model("llama")
    replace_for("llama")(method="kvzip", max_capacity_prompts=32)
    with pytest.raises(ValueError, match=message):
        prefill(model, random_prompt(1, 120), context_span=span)


def test_a_known_generation_length_is_held_once_at_the_prefill():
    """The question and max_new_tokens are known to generate_after_context: each layer holds room for
    exactly them (the last generated token is never fed back), so no buffer grows while decoding."""
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=8)
    _, cache = generate_after_context(model, random_prompt(1, 90), random_prompt(1, 7, seed=2), return_cache=True,
                                      **GENERATE)
    for layer in cache.layers:
        assert layer.tail.appended == 7 + 4 and layer.tail.keys.shape[2] == layer.tail.used + 1
