"""Quantised storage of the compressed cache (--quant_method kivi|kvquant): packing, the
round-trip bound, outliers, honest bytes, decode close to the exact compressed cache."""

import math

import pytest
import torch
from tiny_models import (FAMILY_BACKENDS, assert_rows_match_single_row_runs, decode_in_chunks, greedy, left_padded,
                         random_prompt, random_qkv, replace_for, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import CompressedLayer, cache_nbytes, cache_report, format_report
from restkv.cache.segments.quantized import CODES_PER_BYTE, QuantizedTokens, pack, quantize, unpack
from restkv.integrations.transformers.compat import CACHE_ARGUMENT
from restkv.integrations.transformers.generation import prefill
from restkv.quantizers.kivi import KIVI
from restkv.quantizers.kvquant import KVQuant

SMALL = dict(quant_group_size=4, quant_residual_length=8)  # blocks small enough for 40-token prompts


def random_shape(generator):
    return [int(torch.randint(1, 4, (1,), generator=generator)), int(torch.randint(1, 4, (1,), generator=generator)),
            int(torch.randint(1, 40, (1,), generator=generator)), int(torch.randint(1, 24, (1,), generator=generator))]


@pytest.mark.parametrize("nbits", sorted(CODES_PER_BYTE))
def test_packing_round_trips_every_code_exactly(nbits):
    generator = torch.Generator().manual_seed(nbits)
    for count in (1, 3, 4, 7, 16, 33):
        codes = torch.randint(0, 2**nbits, (2, 3, count), generator=generator).to(torch.uint8)
        packed = pack(codes, nbits)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == math.ceil(count * nbits / 8)
        assert torch.equal(unpack(packed, nbits, count), codes)


def dtype_spacing(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[...]``: the gap from ``|x|`` to the next larger number of ``x``'s dtype."""
    magnitude = x.abs()
    return torch.nextafter(magnitude, torch.full_like(magnitude, math.inf)).float() - magnitude.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("nbits", sorted(CODES_PER_BYTE))
def test_round_trip_error_is_at_most_half_a_step_in_every_dtype(nbits, per_channel, dtype):
    """Property over random tensors, shapes (partial groups included), groups and magnitudes
    (1e-6 to 10: float16's subnormal steps too): half a (stored) step, plus the rounding of the
    result to the dtype; float32 arithmetic adds a few of its own units at the tensor's magnitude."""
    generator = torch.Generator().manual_seed(10 * nbits + per_channel)
    for trial in range(25):
        shape = random_shape(generator)
        group = int(torch.randint(1, 9, (1,), generator=generator))
        magnitude = 10 ** float(torch.rand(1, generator=generator) * 7 - 6)
        x = (torch.randn(shape, generator=generator) * magnitude).to(dtype)
        quantized = quantize(x, nbits, group, per_channel)
        step = quantized.scale.float().repeat_interleave(group, dim=-2 if per_channel else -1)
        step = step[..., : shape[-2], :] if per_channel else step[..., : shape[-1]]
        restored = quantized.dequantize()
        assert restored.dtype == quantized.scale.dtype == dtype
        error = (restored.float() - x.float()).abs()
        bound = step / 2 + dtype_spacing(restored) / 2 + 4 * torch.finfo(torch.float32).eps * x.float().abs().amax()
        assert bool((error <= bound).all()), (trial, shape, group, float((error / step).max()))


def test_unused_slots_do_not_widen_a_key_group():
    x = torch.randn(1, 1, 8, 4)
    valid = torch.ones(1, 1, 8, dtype=torch.bool)
    valid[..., 3] = False
    spoiled = x.clone()
    spoiled[..., 3, :] = 1e4
    assert torch.equal(quantize(spoiled, 4, 8, True, valid).scale, quantize(x, 4, 8, True, valid).scale)
    assert quantize(spoiled, 4, 8, True, valid).scale.amax() < 10


def test_outliers_are_restored_exactly_and_left_out_of_the_range():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 20, 16, generator=generator)
    spikes = torch.rand(x.shape, generator=generator) < 0.03
    x = torch.where(spikes, x.sign() * (8 + 20 * torch.rand(x.shape, generator=generator)), x)
    part = KVQuant(nbits=2, quant_group_size=4, quant_residual_length=8, quant_outlier_threshold=6.0)
    for quantized in (part.quantize_keys(x), part.quantize_values(x)):
        restored = quantized.dequantize()
        outliers = x.abs() > 6.0
        assert quantized.outlier_index.numel() == int(outliers.sum()) > 0
        assert torch.equal(restored[outliers], x[outliers])
        assert float(quantized.scale.amax()) * 3 < 12  # the range holds the dense part only
        for start in range(0, 20, 4):  # block reads restore them too
            assert torch.equal(quantized.dequantize(start, start + 4), restored[:, :, start : start + 4])
    assert KIVI(nbits=2, quant_group_size=4, quant_residual_length=8).quantize_keys(x).outlier_index is None


def quantile_oracle(vector: torch.Tensor, fraction: float) -> torch.Tensor:
    """KVQuant's rule for one vector: its elements at or beyond the two quantiles."""
    upper, lower = torch.quantile(vector, 1 - fraction / 2), torch.quantile(vector, fraction / 2)
    return (vector >= upper) | (vector <= lower)


@pytest.mark.parametrize("fraction", [0.01, 0.2])
def test_kvquant_outliers_are_per_vector_percentiles_by_default(fraction):
    """Values per token (over its channels), keys per channel (over the held tokens): the
    elements beyond their vector's quantiles, however small the vector's magnitude (the fixed
    +-6 of the original release found almost no value outliers)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, 24, 16, generator=generator) * 0.5
    held = torch.rand(2, 2, 24, generator=generator) > 0.2
    part = KVQuant(nbits=2, quant_group_size=4, quant_residual_length=8, quant_outlier_fraction=fraction,
                   quant_exact_sinks=0)
    for quantized, per_channel in ((part.quantize_keys(x, held), True), (part.quantize_values(x, held), False)):
        expected = torch.zeros_like(x, dtype=torch.bool)
        for b, h in ((b, h) for b in range(2) for h in range(2)):
            rows = held[b, h].nonzero().squeeze(-1)
            if per_channel:
                for c in range(16):
                    expected[b, h, rows, c] = quantile_oracle(x[b, h, rows, c], fraction)
            else:
                for t in rows.tolist():
                    expected[b, h, t] = quantile_oracle(x[b, h, t], fraction)
        stored = torch.zeros(x.numel(), dtype=torch.bool)
        stored[quantized.outlier_index.long()] = True
        assert torch.equal(stored.view_as(x), expected)
        restored = quantized.dequantize()
        assert torch.equal(restored[expected], x[expected])
    fixed = KVQuant(nbits=2, quant_group_size=4, quant_residual_length=8, quant_outlier_threshold=6.0)
    assert fixed.quantize_values(x, held).outlier_index.numel() == 0  # |x| < 6 everywhere


def test_the_first_tokens_are_kept_whole_and_out_of_every_range():
    """KVQuant's attention sinks: the slots of each row's first real tokens (left padding,
    slots in any order, residual slots never) stay exact and widen no group."""
    columns = torch.tensor([[[7, 2, 3, -1, 9, 4]], [[0, 5, 1, 6, -1, 2]]])  # [B=2, H=1, S=6]
    padding = torch.tensor([2, 0])
    part = KVQuant(nbits=2, quant_group_size=2, quant_residual_length=8, quant_exact_sinks=2)
    sinks = part.exact_sink_slots(columns, padding)
    assert sinks.tolist() == [[[False, True, True, False, False, False]], [[True, False, True, False, False, False]]]
    assert KIVI(nbits=2, quant_group_size=2, quant_residual_length=8).exact_sink_slots(columns, padding) is None
    assert KVQuant(quant_exact_sinks=0).exact_sink_slots(columns, padding) is None
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(2, 1, 6, 4, generator=generator)
    x[sinks] = 100.0  # sinks far outside the rest
    held = columns >= 0
    for quantize_part in (part.quantize_keys, part.quantize_values):
        quantized = quantize_part(x, held, sinks)
        assert torch.equal(quantized.dequantize()[sinks], x[sinks])
        assert float(quantized.scale.amax()) < 10  # the sinks widen no range
        assert float(quantized.zero.abs().amax()) < 10


def test_batch_maps_keep_codes_and_outliers():
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 12, 8, generator=generator) * 4
    quantized = KVQuant(nbits=4, quant_group_size=4, quant_residual_length=8).quantize_keys(x)
    order = torch.tensor([2, 0, 2, 1])
    mapped = quantized.map_batch(lambda t: t.index_select(0, order.to(t.device)))
    assert torch.equal(mapped.dequantize(), quantized.dequantize()[order])


def test_config_names_the_flags():
    with pytest.raises(ConfigError, match="--nbits"):
        CompressionConfig(max_capacity_prompts=64, quant_method="kivi", nbits=3)
    with pytest.raises(ConfigError, match="--quant_residual_length"):
        CompressionConfig(max_capacity_prompts=64, quant_method="kivi", quant_group_size=64, quant_residual_length=100)
    with pytest.raises(ConfigError, match="--quant_method 'gear'"):
        CompressionConfig(max_capacity_prompts=64, quant_method="gear")
    with pytest.raises(ConfigError, match="--decode_budget"):
        CompressionConfig(decode_budget=64, quant_method="kivi")
    with pytest.raises(ConfigError, match="--quant_outlier_threshold"):
        CompressionConfig(max_capacity_prompts=64, quant_method="kvquant", quant_outlier_threshold=0)
    for fraction in (0, 1, 1.5):
        with pytest.raises(ConfigError, match="--quant_outlier_fraction"):
            CompressionConfig(max_capacity_prompts=64, quant_method="kvquant", quant_outlier_fraction=fraction)
    with pytest.raises(ConfigError, match="--quant_exact_sinks"):
        CompressionConfig(max_capacity_prompts=64, quant_method="kvquant", quant_exact_sinks=-1)
    config = CompressionConfig(max_capacity_prompts=64, quant_method="kvquant", nbits=4)
    assert (config.quant_outlier_fraction, config.quant_outlier_threshold, config.quant_exact_sinks) == (0.01, None, 5)
    assert config.describe() == "--method snapkv --quant_method kvquant"
    assert (config.nbits, config.quant_group_size, config.quant_residual_length) == (4, 64, 128)
    assert CompressionConfig(max_capacity_prompts=64, quant_method="kivi").nbits == 8
    with pytest.warns(UserWarning, match="--quant_outlier_threshold"):
        CompressionConfig(max_capacity_prompts=64, quant_method="kivi", quant_outlier_threshold=3.0)


def expected_layer_bytes(batch, heads, slots, dim, element, nbits, group, tail):
    """Packed codes, scales and zero-points of keys (per channel) and values (per token), the
    int32 columns, and the exact tail tokens with their int32 columns."""
    packed = batch * heads * slots * math.ceil(dim * nbits / 8)
    key_stats = 2 * batch * heads * math.ceil(slots / group) * dim * element
    value_stats = 2 * batch * heads * slots * math.ceil(dim / min(group, dim)) * element
    columns = batch * heads * slots * 4
    return 2 * packed + key_stats + value_stats + columns + batch * heads * tail * (2 * dim * element + 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_snapkv_4_bit_bytes_follow_the_formula(dtype):
    budget, group, length, new_tokens = 32, 4, 90, 3
    model = tiny_model("llama", "eager").to(dtype)
    replace_for("llama")(method="snapkv", max_capacity_prompts=budget, window_size=8, quant_method="kivi", nbits=4,
                         quant_group_size=group, quant_residual_length=8)
    cache = greedy(model, random_prompt(1, length), new_tokens=new_tokens).past_key_values
    heads, dim, element = model.config.num_key_value_heads, model.config.head_dim, torch.finfo(dtype).bits // 8
    coded, exact = budget - 8, 8 + new_tokens - 1  # KIVI's residual: each head's newest 8 kept tokens stay exact
    expected = expected_layer_bytes(1, heads, coded, dim, element, 4, group, exact)
    assert all(layer.used_nbytes() == expected for layer in cache.layers)
    assert sum(report.used_nbytes for report in cache_report(cache)) == model.config.num_hidden_layers * expected
    assert cache_nbytes(cache) >= model.config.num_hidden_layers * expected  # the tail's spare room beside it
    # The coded entries: B x (4 / 16 or 4 / 32) of their full-precision bytes, plus scales and columns.
    full = 2 * heads * coded * dim * element
    overhead = expected - heads * exact * (2 * dim * element + 4) - full * 4 / (8 * element)
    assert overhead == heads * (2 * coded // group * dim + 2 * coded * math.ceil(dim / group)) * element \
        + heads * coded * 4
    assert all(isinstance(layer.kept[0], QuantizedTokens) for layer in cache.layers)


def test_decode_tokens_are_quantised_in_blocks_of_the_residual_length():
    model = tiny_model("llama", "eager")
    replace_for("llama")(method="snapkv", max_capacity_prompts=32, window_size=8, quant_method="kivi", nbits=4,
                         quant_group_size=4, quant_residual_length=8)
    cache = greedy(model, random_prompt(1, 60), new_tokens=20).past_key_values
    layer = cache.layers[0]
    # KIVI's residual of 8: the prompt's newest 8 kept tokens stay exact beside 24 coded ones; the
    # window keeps at least 8 exact, so each time 16 are, the oldest 8 are sealed: the 8 recent
    # prompt tokens, then the first 8 of the 19 appended, leaving 11 exact
    assert layer.tail_length == 19 and layer.tail.appended == 11 and layer.tail.kept_width == 0
    assert [type(segment) for segment in layer.kept] == [QuantizedTokens] * 3 + [type(layer.tail)]
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    block = expected_layer_bytes(1, heads, 8, dim, 4, 4, 4, 0)
    assert layer.used_nbytes() == expected_layer_bytes(1, heads, 24, dim, 4, 4, 4, 11) + 2 * block
    report = cache_report(cache)
    assert report[0].nbytes == layer.nbytes() and report[0].used_nbytes == layer.used_nbytes()
    assert report[0].storage == "kivi 4-bit"
    assert "kivi 4-bit" in format_report(report)


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_8_bit_decode_is_close_to_the_exact_compressed_cache(family, backend):
    """Teacher-forced decode (a 3-token chunk, then single tokens, past the residual length)."""
    model = tiny_model(family, backend)
    input_ids, attention_mask = left_padded([60, 44])
    step = torch.tensor([[7, 9, 11], [5, 6, 8]])
    logits = {}
    for name, options in (("exact", {}), ("kivi", dict(quant_method="kivi", nbits=8, quant_group_size=4,
                                                        quant_residual_length=4))):
        replace_for(family)(method="snapkv", max_capacity_prompts=24, window_size=8, **options)
        cache = prefill(model, input_ids, attention_mask)
        logits[name] = decode_in_chunks(model, cache, attention_mask, step)
    assert any(len(layer.kept) > 2 for layer in cache.layers if isinstance(layer, CompressedLayer) and
               layer.sliding_window is None)
    for ours, exact in zip(logits["kivi"], logits["exact"], strict=True):
        torch.testing.assert_close(ours, exact, rtol=0, atol=5e-3)


def test_low_bit_widths_are_further_from_the_exact_cache_than_8_bits():
    model = tiny_model("llama", "eager")
    ids = random_prompt(1, 80)
    replace_for("llama")(method="snapkv", max_capacity_prompts=32, window_size=8)
    exact = greedy(model, ids, new_tokens=1).logits[0]
    errors = {}
    for nbits in (2, 4, 8):
        replace_for("llama")(method="snapkv", max_capacity_prompts=32, window_size=8, quant_method="kivi",
                             nbits=nbits, **SMALL)
        errors[nbits] = float((greedy(model, ids, new_tokens=2).logits[1] - exact).abs().max())
    assert errors[8] < errors[4] < errors[2]


@pytest.mark.parametrize("quant", ["kivi", "kvquant"])
@pytest.mark.parametrize("extra", [{}, {"allocation": "adakv"}, {"residual": True, "residual_no_validation": True},
                                   {"merge": "pivot"}])
def test_composes_with_allocations_merges_and_the_residual_cache(quant, extra):
    """8-bit codes stay close to the exact cache of the same composition, rows match single rows."""
    model = tiny_model("llama", "eager")
    base = dict(method="snapkv", max_capacity_prompts=24, window_size=8, **extra)
    ids = random_prompt(1, 70)
    replace_for("llama")(**base)
    exact = greedy(model, ids, new_tokens=3)
    replace_for("llama")(**base, quant_method=quant, nbits=8, **SMALL)
    quantized = greedy(model, ids, new_tokens=3)
    for ours, theirs in zip(quantized.logits, exact.logits):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-3)
    if extra.get("residual"):
        assert any(bool(layer.summary_counts.any()) for layer in quantized.past_key_values.layers)
    batched = assert_rows_match_single_row_runs(model, [70, 52])
    assert all(isinstance(layer.kept[0], QuantizedTokens) for layer in batched.past_key_values.layers)


def test_left_padded_batches_and_reruns_are_identical():
    model = tiny_model("qwen2", "sdpa")
    replace_for("qwen2")(method="snapkv", max_capacity_prompts=24, window_size=8, quant_method="kvquant", nbits=2,
                         quant_outlier_threshold=1.0, **SMALL)
    first = assert_rows_match_single_row_runs(model, [60, 41, 30], new_tokens=12)
    input_ids, attention_mask = left_padded([60, 41, 30])
    again = greedy(model, input_ids, attention_mask, new_tokens=12)
    assert torch.equal(first.sequences, again.sequences)
    assert all(torch.equal(a, b) for a, b in zip(first.logits, again.logits))


def test_beam_search_reorders_the_codes():
    model = tiny_model("llama", "eager")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=8, quant_method="kvquant", nbits=4,
                         quant_outlier_threshold=1.0, **SMALL)
    cache = prefill(model, *left_padded([50, 40]))
    layer = cache.layers[0]
    keys = layer.kept_keys.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].kept_keys, keys[[1, 0]])


def test_compress_kv_returns_what_the_quantised_cache_holds():
    """Quantisation is storage: the same tokens are kept, and ``compress_kv`` shows them as the
    model reads them (dequantised), with the codes and scales in its state."""
    query, key, value = random_qkv(length=80)
    exact = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=24, window_size=8))
    quantized = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=24, window_size=8,
                                                    quant_method="kivi", nbits=2, quant_group_size=8,
                                                    quant_residual_length=8))
    assert torch.equal(exact.indices, quantized.indices)
    assert not torch.equal(exact.keys, quantized.keys)
    codes, recent = quantized.state.kept  # the 16 older tokens coded, the newest 8 exact (KIVI's residual)
    assert isinstance(codes, QuantizedTokens) and codes.keys.nbits == 2 and codes.columns.shape[-1] == 16
    torch.testing.assert_close(quantized.keys[:, :, :16], codes.keys.dequantize())
    assert torch.equal(quantized.keys[:, :, 16:], exact.keys[:, :, 16:])
    step = codes.keys.scale.repeat_interleave(8, dim=-2)
    assert bool(((quantized.keys[:, :, :16] - exact.keys[:, :, :16]).abs() <= step / 2 + 1e-6).all())


def test_layers_compressed_after_the_whole_prefill_are_stored_quantised_and_pruned():
    """KVzip's model-wide allocation (restkv.integrations.transformers.deferred) keeps the same entries, quantised and pruned."""
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_prompt(1, 70)
    base = dict(method="kvzip", max_capacity_prompts=12, reconstruction_chunk=32)
    replace_for("llama")(**base)
    exact = greedy(model, ids, new_tokens=3)
    replace_for("llama")(**base, quant_method="kivi", nbits=8, **SMALL)
    quantized = greedy(model, ids, new_tokens=3)
    for ours, theirs in zip(quantized.past_key_values.layers, exact.past_key_values.layers):
        assert isinstance(ours.kept[0], QuantizedTokens) and torch.equal(ours.kept_columns, theirs.kept_columns)
    for ours, theirs in zip(quantized.logits, exact.logits):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-3)
    replace_for("llama")(**base, think=True, recent_size=0, pruning_ratio=0.5)
    pruned = greedy(model, ids, new_tokens=3).past_key_values
    assert all(layer.storage == "keys 8/16 channels" for layer in pruned.layers)


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_kivi_keeps_each_heads_newest_residual_tokens_exact(method):
    """Issue 19 item 5: KIVI keeps its residual R in full precision; every kept token was once
    quantised, the observation window included. Each head's newest R kept tokens (heads differ
    under AdaKV) are the exact keys and values; the older ones are coded."""
    query, key, value = random_qkv(length=80)
    options = dict(method=method, max_capacity_prompts=24, window_size=4)
    exact = compress_kv(query, key, value, options)
    quantized = compress_kv(query, key, value, dict(options, quant_method="kivi", nbits=2, quant_group_size=4,
                                                    quant_residual_length=8))
    assert torch.equal(exact.indices, quantized.indices)
    held = (exact.indices >= 0).sum(dim=-1)
    for head in range(key.shape[1]):
        newest = slice(int(held[0, head]) - 8, int(held[0, head]))
        assert torch.equal(quantized.keys[0, head, newest], exact.keys[0, head, newest])
        assert torch.equal(quantized.values[0, head, newest], exact.values[0, head, newest])
        assert not torch.equal(quantized.keys[0, head, : newest.start], exact.keys[0, head, : newest.start])


def test_kivi_decoding_keeps_at_least_its_residual_exact():
    """While decoding the newest R = 4 tokens stay exact at every step (between R and 2R - 1 of
    them: blocks of R are sealed), and the layer reads them as the model wrote them."""
    model = tiny_model("llama", "eager")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4, quant_method="kivi", nbits=2,
                         quant_group_size=4, quant_residual_length=4)
    exact_window = []

    def record(module, args, kwargs, output):
        layer = kwargs[CACHE_ARGUMENT].layers[module.layer_idx]
        exact_window.append(int(layer.tail.held_counts().min()))

    handle = model.model.layers[1].self_attn.register_forward_hook(record, with_kwargs=True)
    greedy(model, random_prompt(1, 60), new_tokens=15)
    handle.remove()
    assert exact_window == [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6]
