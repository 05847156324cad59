"""ThinK key-channel pruning (--method think, --think): ratio 0 is the base method, zero
channels are the ones dropped, pruned storage reads like masked queries, memory follows."""

import pytest
import torch
from tiny_models import (FAMILY_BACKENDS, assert_rows_match_single_row_runs, decode_in_chunks, greedy, left_padded,
                         random_prompt, random_qkv, replace_for, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import CompressedLayer, cache_report
from restkv.cache.segments.pruned_keys import PrunedKeyTokens
from restkv.integrations.transformers.generation import prefill

BASE = dict(max_capacity_prompts=24, window_size=8, recent_size=8)


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_ratio_zero_is_the_base_method_bit_for_bit(family, backend):
    model = tiny_model(family, backend)
    input_ids, attention_mask = left_padded([50, 36])
    replace_for(family)(method="snapkv", max_capacity_prompts=24, window_size=8)
    reference = greedy(model, input_ids, attention_mask, new_tokens=4)
    for options in (dict(method="think"), dict(method="snapkv", think=True)):
        replace_for(family)(**options, **BASE, pruning_ratio=0.0)
        ours = greedy(model, input_ids, attention_mask, new_tokens=4)
        assert torch.equal(ours.sequences, reference.sequences)
        assert all(torch.equal(a, b) for a, b in zip(ours.logits, reference.logits))


def test_all_zero_key_channels_are_the_ones_pruned():
    query, key, value = random_qkv(batch=2, length=80)
    zero = [1, 6, 9, 14]
    key[..., zero] = 0
    kept = compress_kv(query, key, value, dict(method="think", pruning_ratio=0.25, **BASE))
    others = torch.tensor([c for c in range(16) if c not in zero])
    assert torch.equal(kept.key_channels, others.expand(2, 2, -1))
    # On another scorer, with a different channel per head.
    key = random_qkv(batch=2, length=80)[1]
    key[:, 0, :, 3] = 0
    key[:, 1, :, 11] = 0
    kept = compress_kv(query, key, value, dict(method="h2o", think=True, pruning_ratio=1 / 16, **BASE))
    assert 3 not in kept.key_channels[:, 0].flatten().tolist() and kept.key_channels.shape[-1] == 15
    assert 11 not in kept.key_channels[:, 1].flatten().tolist()


def test_the_channel_energy_counts_the_recent_tokens_keys():
    """ThinK's release scores a channel by the energy of every kept key, the recent (whole)
    tokens' too: a channel that only the recent tokens use is kept."""
    query, key, value = random_qkv(length=80)
    key[..., 5] = 0.0
    key[..., -8:, 5] = 40.0  # the recent tokens alone use channel 5
    kept = compress_kv(query, key, value, dict(method="think", pruning_ratio=0.5, **BASE))
    assert all(5 in channels for channels in kept.key_channels[0].tolist())
    # The oracle: the group's mean query energy over the window times the kept keys' mean energy.
    plain = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=24, window_size=8))
    query_power = query[:, :, -8:].pow(2).mean(dim=2).view(1, 2, 2, 16).mean(dim=2)
    importance = query_power * plain.keys.pow(2).mean(dim=2)
    expected = importance.topk(8, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(kept.key_channels, expected)


def test_dropped_channels_are_zero_outside_the_recent_tokens():
    query, key, value = random_qkv(length=80)
    kept = compress_kv(query, key, value, dict(method="think", pruning_ratio=0.5, **BASE))
    plain = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=24, window_size=8))
    assert torch.equal(kept.indices, plain.indices) and torch.equal(kept.values, plain.values)
    recent = kept.indices >= 80 - 8
    dropped = torch.ones(1, 2, 16, dtype=torch.bool).scatter_(-1, kept.key_channels, False)
    for head in range(2):
        older = kept.keys[0, head][~recent[0, head]]
        assert bool((older[:, dropped[0, head]] == 0).all())
        assert torch.equal(older[:, ~dropped[0, head]], plain.keys[0, head][~recent[0, head]][:, ~dropped[0, head]])
        assert torch.equal(kept.keys[0, head][recent[0, head]], plain.keys[0, head][recent[0, head]])


def test_pruned_storage_reads_like_zeroed_keys():
    """Selecting the kept query channels against compact keys = full queries against keys whose
    dropped channels are zero; the recent tokens sit whole in the tail."""
    query, key, value = random_qkv(length=80)
    config = CompressionConfig(method="think", pruning_ratio=0.4, **BASE)
    kept = compress_kv(query, key, value, config)
    columns = kept.indices.to(torch.int32)
    pruned = CompressedLayer.from_state(kept.state, 80, None, config)
    zeroed = CompressedLayer.from_tokens(kept.keys, kept.values, columns, tokens_seen=80)
    assert isinstance(pruned.kept[0], PrunedKeyTokens) and pruned.kept[0].inner.keys.shape[-1] == 16 - 6
    assert pruned.tail.kept_counts().tolist() == [[8, 8]]  # the recent tokens, whole, open the tail
    new_query, new_key, new_value = random_qkv(length=3, seed=5)
    for layer in (pruned, zeroed):
        layer.output = layer.attend(new_query, new_key, new_value, None, 0.25)
    torch.testing.assert_close(pruned.output, zeroed.output, rtol=1e-5, atol=1e-6)


def test_memory_follows_the_ratio():
    model = tiny_model("llama", "eager")
    ids = random_prompt(1, 90)
    replace_for("llama")(method="think", pruning_ratio=0.5, **BASE)
    cache = greedy(model, ids, new_tokens=3).past_key_values
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    older, recent, tail = 24 - 8, 8, 2
    # float32 compact keys, values, int32 columns, whole recent and tail tokens with their columns, int64 channels
    expected = 4 * heads * (older * dim // 2 + older * dim + older + (recent + tail) * (2 * dim + 1)) \
        + 8 * heads * dim // 2
    assert all(layer.used_nbytes() == expected for layer in cache.layers)
    assert cache_report(cache)[0].storage == "keys 8/16 channels"
    assert cache_report(cache)[0].stored_max == 24 + tail


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_rows_match_single_rows_and_decode_runs_in_chunks(family, backend):
    model = tiny_model(family, backend)
    replace_for(family)(method="think", **BASE)
    assert_rows_match_single_row_runs(model, [50, 36, 30])
    input_ids, attention_mask = left_padded([50, 36])
    runs = []
    for _ in range(2):
        cache = prefill(model, input_ids, attention_mask)
        runs.append(decode_in_chunks(model, cache, attention_mask, torch.tensor([[7, 9, 11], [5, 6, 8]])))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert any(isinstance(layer, CompressedLayer) and isinstance(layer.kept[0], PrunedKeyTokens)
               for layer in cache.layers)


def test_composes_with_quantisation_and_the_residual_cache():
    model = tiny_model("llama", "eager")
    options = dict(method="snapkv", think=True, residual=True, residual_no_validation=True, quant_method="kivi",
                   nbits=8, quant_group_size=4, quant_residual_length=8, **BASE)
    replace_for("llama")(**options)
    batched = assert_rows_match_single_row_runs(model, [70, 52], new_tokens=12)
    layer = batched.past_key_values.layers[0]
    assert layer.storage == "kivi 8-bit, keys 10/16 channels" and bool(layer.summary_counts.any())
    # the exact window (KIVI's residual of 8) sealed its oldest 8, the prompt's recent tokens, into a block
    assert len(layer.kept) == 3 and type(layer.kept[1]).__name__ == "QuantizedTokens" and layer.tail.appended == 11


def test_config_names_the_flags():
    with pytest.raises(ConfigError, match="--no-think"):
        CompressionConfig(method="think", think=False, max_capacity_prompts=64)
    for options, recent in ((dict(method="think"), 32), (dict(method="think", window_size=8), 8),
                            (dict(method="tova", think=True), 1), (dict(method="kvzip", think=True), 0)):
        config = CompressionConfig(**options, max_capacity_prompts=64)
        assert config.switch("think").exact_recent_tokens(config) == recent
    with pytest.raises(ConfigError, match="--pruning_ratio"):
        CompressionConfig(method="think", max_capacity_prompts=64, pruning_ratio=1.0)
    with pytest.raises(ConfigError, match="--decode_budget"):
        CompressionConfig(method="think", decode_budget=64)
    config = CompressionConfig(method="think", max_capacity_prompts=64)
    assert (config.pruning_ratio, config.recent_size, config.think) == (0.4, 32, True)
    assert config.describe() == "--method think"
    assert CompressionConfig(method="h2o", think=True, max_capacity_prompts=64).describe() == "--method h2o --think"


def test_a_layer_whose_prompt_fits_the_budget_stays_exact():
    """A budget at or above the prompt reproduces the unpatched model with --think as with every method."""
    model = tiny_model("llama")
    ids = random_prompt(1, 40)
    reference = greedy(model, ids, new_tokens=4)
    replace_for("llama")(method="think", pruning_ratio=0.5, recent_size=4, max_capacity_prompts=64, window_size=4)
    out = greedy(model, ids, new_tokens=4)
    assert torch.equal(out.sequences, reference.sequences)
    for ours, theirs in zip(out.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(layer, CompressedLayer) for layer in out.past_key_values.layers)


def test_prune_fitting_layers_prunes_a_layer_whose_prompt_fits_the_budget_as_the_release_does():
    """Issue 19 item 9: ThinK's release prunes key channels whether or not the layer evicts; with
    --prune_fitting_layers a 40-token prompt under a budget of 64 keeps every token, its older keys
    with half the channels."""
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", think=True, pruning_ratio=0.5, recent_size=4, max_capacity_prompts=64,
                         window_size=4, prune_fitting_layers=True)
    cache = prefill(model, random_prompt(1, 40))
    for layer in cache.layers:
        assert isinstance(layer, CompressedLayer) and layer.kept_counts.tolist() == [[40, 40]]
        assert isinstance(layer.kept[0], PrunedKeyTokens) and layer.storage == "keys 8/16 channels"
        assert layer.tail.kept_counts().tolist() == [[4, 4]]  # the recent tokens whole
