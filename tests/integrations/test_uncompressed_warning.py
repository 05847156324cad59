"""A prompt kept whole because it fits its budget says so, once per budget in a process."""

import warnings

import pytest
from tiny_models import left_padded, random_prompt, tiny_model

import restkv
import restkv.integrations.transformers.patching as patching
from restkv import UncompressedPromptWarning, compression, generate_after_context


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """No budget warned about yet, as in a new process."""
    monkeypatch.setattr(patching, "_WARNED_FITTING", set())


def fitting_warnings(model, prompt, attention_mask=None, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compression(model, **options):
            for _ in range(2):
                model.generate(prompt, attention_mask=attention_mask, max_new_tokens=2, do_sample=False,
                               pad_token_id=0)
    return [str(w.message) for w in caught if w.category is UncompressedPromptWarning]


def test_a_prompt_that_fits_its_budget_warns_once_per_budget():
    model = tiny_model("llama")
    (message,) = fitting_warnings(model, random_prompt(1, 30), method="snapkv", max_capacity_prompts=40,
                                  window_size=8)
    assert "the prompt (30 tokens) fits max_capacity_prompts=40, so it is kept whole" in message
    assert "\n" not in message
    assert fitting_warnings(model, random_prompt(1, 35), method="snapkv", max_capacity_prompts=40) == []
    assert len(fitting_warnings(model, random_prompt(1, 35), method="h2o", max_capacity_prompts=48)) == 1


@pytest.mark.parametrize("options", [
    dict(method="snapkv", max_capacity_prompts=24, window_size=8),  # compressed
    dict(method="snapkv", compression_ratio=0.5, window_size=8),  # a ratio always removes something
    dict(method="fullkv"),  # nothing to compress
    dict(method="snapkv", max_capacity_prompts=64, decode_budget=40, window_size=8),  # compressed while it decodes
    dict(method="think", max_capacity_prompts=64, window_size=8, prune_fitting_layers=True),  # fits; keys pruned
])
def test_a_compressed_prompt_or_one_without_a_prefill_budget_is_silent(options):
    assert fitting_warnings(tiny_model("llama"), random_prompt(1, 30), **options) == []


def test_the_longest_real_row_decides_and_query_agnostic_contexts_are_checked_too():
    model = tiny_model("llama")
    prompt, mask = left_padded([30, 20])
    assert len(fitting_warnings(model, prompt, mask, method="snapkv", max_capacity_prompts=30, window_size=8)) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with compression(model, method="snapkv", max_capacity_prompts=64, window_size=8):
            generate_after_context(model, random_prompt(1, 50), random_prompt(1, 5), max_new_tokens=1,
                                   pad_token_id=0)
    assert [w.category for w in caught if issubclass(w.category, UncompressedPromptWarning)] == \
        [UncompressedPromptWarning]
    assert restkv.UncompressedPromptWarning is patching.UncompressedPromptWarning
