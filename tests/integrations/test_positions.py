"""RoPE continuity after compression: the next token's position is the number of tokens seen."""

import torch
from tiny_models import random_prompt, replace_for, tiny_model
from transformers import DynamicCache

from restkv.cache import cache_report
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.generation import prefill


def record_positions(model):
    """Position ids the rotary embedding receives, per forward."""
    seen = []
    handle = model.model.rotary_emb.register_forward_hook(
        lambda module, args, kwargs, output: seen.append(kwargs["position_ids"].clone()), with_kwargs=True
    )
    return seen, handle


def test_decode_positions_equal_tokens_seen_without_explicit_position_ids():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=20, window_size=8)
    cache = prefill(model, random_prompt(1, 90))
    assert cache.get_seq_length() == 90
    positions, handle = record_positions(model)
    token = torch.tensor([[5]])
    with torch.no_grad():
        for step in range(3):
            model(token, **with_cache(cache))  # no position_ids: transformers asks the cache
    handle.remove()
    assert [p.flatten().tolist() for p in positions] == [[90], [91], [92]]
    assert all(r.stored_max == 20 + 3 for r in cache_report(cache))


def test_generate_matches_a_manual_greedy_loop_after_compression():
    model = tiny_model("qwen2")
    prompt = random_prompt(1, 100)
    replace_for("qwen2")(method="h2o", max_capacity_prompts=30, window_size=8)
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False)[0, 100:]
    cache = DynamicCache(config=model.config)
    manual = []
    with torch.no_grad():
        logits = model(prompt, **with_cache(cache)).logits
        for _ in range(8):
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            manual.append(int(token))
            logits = model(token, **with_cache(cache)).logits  # positions come from the cache
    assert manual == generated.tolist()
    assert all(r.compressed for r in cache_report(cache))
