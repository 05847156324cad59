"""Patching, per-model configuration, unpatching, unsupported models and versions."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from restkv.compat import UnsupportedTransformersVersion, check_transformers_version, output_cache
from restkv.config import ConfigError
from restkv.monkeypatch import config_of, configure, family_of, replace_for_model, replace_llama, unpatch
from tiny_models import random_prompt, tiny_model


def test_unpatch_restores_bitwise_identical_outputs():
    original_forward = LlamaAttention.forward
    model = tiny_model("llama")
    prompt = random_prompt(1, 60)
    with torch.no_grad():
        before = model(prompt).logits
        replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4)
        assert LlamaAttention.forward is not original_forward
        unpatch()
        after = model(prompt).logits
    assert LlamaAttention.forward is original_forward
    assert not hasattr(LlamaAttention, "_restkv_config")
    assert torch.equal(before, after)


def test_configure_changes_one_model_without_repatching():
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    replace_llama(method="snapkv", max_capacity_prompts=64)
    configure(first, method="h2o", max_capacity_prompts=16, window_size=4)
    assert config_of(first).method == "h2o" and config_of(first).max_capacity_prompts == 16
    assert config_of(second).method == "snapkv" and config_of(second).max_capacity_prompts == 64
    out = first.generate(random_prompt(1, 60), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert output_cache(out).layers[0].kept_counts.max() == 16


def test_configure_validates_like_the_config():
    model = tiny_model("llama")
    replace_llama(method="snapkv", max_capacity_prompts=64)
    with pytest.raises(ConfigError, match="--window_size 32 must be smaller"):
        configure(model, max_capacity_prompts=32)


def test_configure_needs_a_patched_family():
    with pytest.raises(RuntimeError, match="replace_llama"):
        configure(tiny_model("llama"), max_capacity_prompts=16)


def test_replace_for_model_dispatches_on_model_type():
    model = tiny_model("gemma3")
    config = replace_for_model(model, method="tova", max_capacity_prompts=16)
    assert config_of(model) == config


def test_unsupported_model_type_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported by restkv; supported: .*llama"):
        family_of(model)
    with pytest.raises(ValueError, match="not supported"):
        replace_for_model(model, method="snapkv", max_capacity_prompts=16)


@pytest.mark.parametrize("version", ["4.57.1", "5.40.0", "6.0.0"])
def test_transformers_outside_the_tested_range_is_refused(version):
    with pytest.raises(UnsupportedTransformersVersion, match=f"found {version}.*pip install"):
        check_transformers_version(version)


def test_installed_transformers_is_supported():
    check_transformers_version()


def test_patching_before_loading_works_too():
    replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4)
    model = tiny_model("llama")
    out = model.generate(random_prompt(1, 50), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(model, LlamaForCausalLM)
    assert output_cache(out).layers[0].kept_counts.max() == 16
