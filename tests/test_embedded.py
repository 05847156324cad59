"""The real embedded SmolLM2-135M end to end (and its weights in Mistral/Qwen2 layouts)."""

import re

import pytest
import torch
from needle_prompts import needle_chat_prompt
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from restkv.cache import cache_report
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.patching import replace_for_model

pytestmark = pytest.mark.embedded


def first_number(text: str) -> str:
    match = re.search(r"\d+", text)
    return match.group(0) if match else ""


def greedy(model, input_ids, attention_mask=None, new_tokens=8):
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )


def assert_same_generation(patched, reference):
    assert torch.equal(patched.sequences, reference.sequences)
    for ours, theirs in zip(patched.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    texts = [needle_chat_prompt(tokenizer, n, 0.5) for n in (300, 180, 90)]
    return tokenizer(texts, return_tensors="pt", padding=True)


def same_weights_as(llama, config_cls, model_cls, **extra):
    """The SmolLM2 weights in another family's layout (identical maths)."""
    source = llama.config
    config = config_cls(
        vocab_size=source.vocab_size, hidden_size=source.hidden_size, intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads, head_dim=source.head_dim,
        max_position_embeddings=source.max_position_embeddings, rms_norm_eps=source.rms_norm_eps,
        rope_parameters=dict(source.rope_parameters), tie_word_embeddings=True,
        bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id, pad_token_id=source.pad_token_id, **extra,
    )
    config._attn_implementation = llama.config._attn_implementation
    model = model_cls(config).eval()
    state = dict(llama.state_dict())
    for name, param in model.state_dict().items():
        if name not in state:  # Qwen2's q/k/v biases
            state[name] = torch.zeros_like(param)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("layout", ["llama", "mistral", "qwen2"])
def test_budget_at_or_above_prompt_is_exact_on_real_weights(smollm2, prompts, layout):
    llama, _ = smollm2
    if layout == "mistral":
        model = same_weights_as(llama, MistralConfig, MistralForCausalLM, sliding_window=None)
    elif layout == "qwen2":
        model = same_weights_as(llama, Qwen2Config, Qwen2ForCausalLM)
    else:
        model = llama
    ids, mask = prompts.input_ids, prompts.attention_mask
    reference = greedy(llama, ids, mask)
    if layout != "llama":  # the other layouts compute the same function
        assert_same_generation(greedy(model, ids, mask), reference)
    replace_for_model(model, method="snapkv", max_capacity_prompts=ids.shape[1])
    assert_same_generation(greedy(model, ids, mask), reference)


def test_needle_is_answered_with_the_full_cache_and_kept_under_compression(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer(needle_chat_prompt(tokenizer, 2200, 0.4), return_tensors="pt").input_ids
    length = prompt.shape[1]
    full = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert first_number(tokenizer.decode(full[0, length:])) == "6433012"

    budget = length // 4
    replace_for_model(model, method="snapkv", max_capacity_prompts=budget)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    assert all(r.compressed for r in cache_report(output_cache(out)))
    # SmolLM2 spreads its attention to the needle over many heads, so window scorers keep
    # only part of a multi-token number (a 7-digit one comes back truncated): check that the
    # needle's digit tokens survive far more often than the budget fraction, and the answer's
    # leading digit.
    digits = tokenizer("6433012", add_special_tokens=False).input_ids
    ids = prompt[0].tolist()
    start = next(i for i in range(length) if ids[i : i + len(digits)] == digits)
    needle = torch.arange(start, start + len(digits))
    retention = torch.stack(
        [torch.isin(needle, columns).float().mean() for layer in output_cache(out).layers for columns in layer.kept_columns[0]]
    ).mean()
    assert retention > 1.5 * budget / length, float(retention)
    assert first_number(tokenizer.decode(out.sequences[0, length:])).startswith("6")


@pytest.fixture(scope="module")
def gemma3():
    from restkv.integrations.transformers.models import load_model, load_tokenizer

    return load_model("gemma3-270m", attn_implementation="sdpa"), load_tokenizer("gemma3-270m")


def test_gemma3_sliding_and_full_layers(gemma3):
    """Gemma 3: exact at a budget above the prompt; below the sliding window every layer
    (sliding ones included) is compressed and stored at one KV head."""
    model, tokenizer = gemma3
    text = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(90))
    prompt = tokenizer(text, return_tensors="pt").input_ids
    reference = greedy(model, prompt, new_tokens=4)
    replace_for_model(model, method="snapkv", max_capacity_prompts=prompt.shape[1])
    assert_same_generation(greedy(model, prompt, new_tokens=4), reference)

    replace_for_model(model, method="snapkv", max_capacity_prompts=128)
    out = greedy(model, prompt, new_tokens=4)
    layers = output_cache(out).layers
    assert prompt.shape[1] > 511 and len(layers) == 18
    assert all(layer.kept_counts.tolist() == [[128]] for layer in layers)
    assert sum(layer.is_sliding for layer in layers) == 15
