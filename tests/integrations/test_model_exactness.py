"""Budget >= prompt length: every family behaves exactly as unpatched (eager and sdpa,
batch 1 and a left-padded batch of 3)."""

import pytest
import torch
from tiny_models import (FAMILIES, FAMILY_BACKENDS, assert_patch_reproduces_unpatched, greedy, left_padded,
                         random_prompt, replace_for, tiny_model)

from restkv.cache import cache_report
from restkv.integrations.transformers.compat import output_cache

NEW_TOKENS = 6


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("batch", ["single", "left_padded_3"])
def test_budget_at_or_above_prompt_reproduces_unpatched_outputs(family, backend, batch):
    model = tiny_model(family, backend)
    if batch == "single":
        input_ids, attention_mask = random_prompt(1, 70), None
    else:
        input_ids, attention_mask = left_padded([70, 52, 31])
    assert_patch_reproduces_unpatched(model, family, input_ids, attention_mask, new_tokens=NEW_TOKENS,
                                      method="snapkv", max_capacity_prompts=70, window_size=8)


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_compression_changes_the_cache_for_every_family(family, backend):
    """The same prompt under a small budget really is compressed (no silent fallback)."""
    model = tiny_model(family, backend)
    replace_for(family)(method="snapkv", max_capacity_prompts=24, window_size=8)
    out = greedy(model, random_prompt(1, 70), new_tokens=NEW_TOKENS)
    reports = cache_report(output_cache(out))
    assert all(report.compressed for report in reports)
    assert {report.stored_max for report in reports} == {24 + NEW_TOKENS - 1}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_context_manager_compresses_any_family_and_restores_it(family):
    """``restkv.compression(model, ...)`` finds the model's family itself (a table entry or transformers'
    auto mappings), compresses inside the block, and leaves the model as unpatched after it."""
    import restkv

    model = tiny_model(family, "eager")
    input_ids = random_prompt(1, 70)
    reference = greedy(model, input_ids, new_tokens=NEW_TOKENS)
    with restkv.compression(model, method="snapkv", max_capacity_prompts=24, window_size=8):
        inside = greedy(model, input_ids, new_tokens=NEW_TOKENS)
    assert all(report.compressed for report in cache_report(output_cache(inside)))
    after = greedy(model, input_ids, new_tokens=NEW_TOKENS)
    assert torch.equal(after.sequences, reference.sequences)
    for ours, theirs in zip(after.logits, reference.logits):
        assert torch.equal(ours, theirs)
