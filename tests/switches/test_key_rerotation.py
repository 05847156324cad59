"""Key re-rotation after eviction (--rerotate_keys): each head's kept keys at consecutive positions."""

import pytest
import torch
from tiny_models import (assert_model_compresses, assert_rows_match_single_row_runs, greedy, random_prompt, replace_for,
                         rope_tables, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.scoring.rope import rotate


def rope_at(positions: torch.Tensor, dim: int, base: float = 10000.0):
    """Default RoPE ``(cos, sin)`` ``[1, n, dim]`` at ``positions`` ``[n]`` (the test's own tables)."""
    angles = positions[:, None].double() / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([angles, angles], dim=-1)[None]
    return angles.cos().float(), angles.sin().float()


def rotated_inputs(length=80, dim=16, seed=3):
    """Pre-RoPE keys and the post-RoPE query/key/value a forward would hand ``compress_kv``."""
    generator = torch.Generator().manual_seed(seed)
    plain_query = torch.randn(1, 4, length, dim, generator=generator)
    plain_key = torch.randn(1, 2, length, dim, generator=generator) * (1 + torch.rand(1, 2, length, 1, generator=generator))
    value = torch.randn(1, 2, length, dim, generator=generator)
    cos, sin = rope_tables(plain_query)
    return plain_key, rotate(plain_query, cos, sin), rotate(plain_key, cos, sin), value, (cos, sin)


def test_each_heads_kept_keys_sit_at_the_consecutive_positions_ending_at_the_prompts_last():
    plain_key, query, key, value, rotary = rotated_inputs()
    options = dict(method="l2norm", max_capacity_prompts=24, window_size=0, l2norm_skip_layers=[])
    plain = compress_kv(query, key, value, options, rotary=rotary)
    turned = compress_kv(query, key, value, dict(options, rerotate_keys=True), rotary=rotary)
    assert torch.equal(turned.indices, plain.indices) and torch.equal(turned.values, plain.values)
    for head in range(2):
        kept = turned.indices[0, head]
        targets = torch.arange(80 - len(kept), 80)
        expected = rotate(plain_key[:, head : head + 1, kept], *rope_at(targets, 16))
        torch.testing.assert_close(turned.keys[:, head : head + 1], expected, rtol=1e-5, atol=1e-5)


def test_a_later_query_sees_each_kept_key_at_kvpress_compact_distance():
    """kvpress puts a head's n kept keys at 0..n-1 and the next token at n; restkv's keys end at the
    prompt's last position and the next token stays at N: every attention logit is the same."""
    plain_key, query, key, value, rotary = rotated_inputs()
    options = dict(method="l2norm", max_capacity_prompts=24, window_size=0, l2norm_skip_layers=[], rerotate_keys=True)
    turned = compress_kv(query, key, value, options, rotary=rotary)
    new_query = torch.randn(1, 1, 3, 16, generator=torch.Generator().manual_seed(9))
    ours = rotate(new_query, *rope_at(torch.arange(80, 83), 16)) @ turned.keys[0, 0].T
    kvpress_keys = rotate(plain_key[:, :1, turned.indices[0, 0]], *rope_at(torch.arange(24), 16))
    theirs = rotate(new_query, *rope_at(torch.arange(24, 27), 16)) @ kvpress_keys[0, 0].T
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_ragged_heads_each_end_at_the_prompts_last_position():
    plain_key, query, key, value, rotary = rotated_inputs(seed=5)
    out = compress_kv(query * 3, key, value, dict(method="snapkv", max_capacity_prompts=24, window_size=8,
                                              allocation="adakv", rerotate_keys=True), rotary=rotary)
    counts = (out.indices >= 0).sum(dim=-1)[0].tolist()
    assert counts[0] != counts[1]
    for head, count in enumerate(counts):
        expected = rotate(plain_key[:, head : head + 1, out.indices[0, head, :count]],
                          *rope_at(torch.arange(80 - count, 80), 16))
        torch.testing.assert_close(out.keys[:, head : head + 1, :count], expected, rtol=1e-5, atol=1e-5)


def test_rerotation_needs_the_rope_tables():
    _, query, key, value, _ = rotated_inputs()
    with pytest.raises(ValueError, match="--rerotate_keys.*rotary="):
        compress_kv(query, key, value, dict(method="l2norm", max_capacity_prompts=24, window_size=0, rerotate_keys=True,
                                            l2norm_skip_layers=[]))


@pytest.mark.parametrize("extra, named", [(dict(decode_budget=40), "--decode_budget"),
                                          (dict(prefill_chunk_size=32), "--prefill_chunk_size"),
                                          (dict(residual=True), "residual"),
                                          (dict(method="momentkv"), "momentkv")])
def test_what_would_rotate_keys_twice_or_keep_them_unturned_is_refused(extra, named):
    with pytest.raises(ConfigError, match=f"--rerotate_keys.*{named}"):
        CompressionConfig(**{"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8, "rerotate_keys": True,
                             **extra})


def test_the_model_stores_turned_keys_and_keeps_the_prompt_positions():
    model = tiny_model("llama")
    prompt = random_prompt(1, 90)
    options = dict(method="snapkv", max_capacity_prompts=30, window_size=8)
    replace_for("llama")(**options)
    plain = output_cache(greedy(model, prompt, new_tokens=1))
    replace_for("llama")(**options, rerotate_keys=True)
    turned = output_cache(greedy(model, prompt, new_tokens=1))
    assert [layer.exact for layer in kept_positions(turned)] == [layer.exact for layer in kept_positions(plain)]
    first_plain, first_turned = (cache.layers[0].kept_tokens(appended=False)[0] for cache in (plain, turned))
    assert not torch.allclose(first_plain, first_turned)
    assert torch.allclose(first_plain.norm(dim=-1), first_turned.norm(dim=-1), atol=1e-4)  # a rotation


@pytest.mark.parametrize("extra", [dict(), dict(allocation="adakv"), dict(method="kvzip"),
                                   dict(quant_method="kivi", nbits=4), dict(think=True)])
def test_rerotation_composes_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8, "rerotate_keys": True,
                             **extra})


def test_a_padded_row_is_turned_as_it_is_alone():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8, rerotate_keys=True)
    assert_rows_match_single_row_runs(model, [70, 52])
