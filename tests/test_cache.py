"""The compressed cache: budget, memory, GQA storage, segments, state between prompts."""

import pytest
import torch

from restkv.cache import Segment, attend_segments
from restkv.residual import ResidualReadout
from restkv.cache import CompressedLayer, cache_nbytes, cache_report, format_report
from restkv.compat import output_cache, with_cache
from restkv.generation import prefill
from tiny_models import FAMILY_BACKENDS, decode_in_chunks, left_padded, random_prompt, replace_for, tiny_model


def full_cache_as_compressed(model, input_ids, attention_mask):
    """Prefill natively, then hand every layer's full K/V to a CompressedLayer (nothing dropped)."""
    cache = prefill(model, input_ids, attention_mask)
    length = input_ids.shape[1]
    padding = (length - attention_mask.sum(dim=-1))[:, None, None]
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        columns = torch.arange(length).expand(*keys.shape[:3]).clone()
        columns = columns.masked_fill(columns < padding, -1)
        sliding = getattr(layer, "sliding_window", None)
        cache.layers[index] = CompressedLayer(keys, values, columns, tokens_seen=length, sliding_window=sliding)
    return cache


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_attention_over_segments_equals_native_decode(family, backend):
    """Decode over a compressed layer that holds every token (padding excluded) gives the
    native logits: the segmented softmax, masks and positions are right."""
    model = tiny_model(family, backend)
    input_ids, attention_mask = left_padded([40, 25])
    native_cache = prefill(model, input_ids, attention_mask)
    compressed_cache = full_cache_as_compressed(model, input_ids, attention_mask)
    replace_for(family)(method="snapkv", max_capacity_prompts=20, window_size=8)
    step = torch.tensor([[7, 9, 11], [5, 6, 8]])  # a 3-token chunk, then single tokens
    native = decode_in_chunks(model, native_cache, attention_mask, step)
    ours = decode_in_chunks(model, compressed_cache, attention_mask, step)
    for our, reference in zip(ours, native, strict=True):
        torch.testing.assert_close(our, reference, rtol=1e-4, atol=1e-4)
    assert all(isinstance(layer, CompressedLayer) for layer in compressed_cache.layers)


def test_shared_softmax_with_residual_log_count_bias_is_one_softmax_over_all_entries():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 1, 4, generator=generator)
    main_k, main_v = torch.randn(1, 1, 3, 4, generator=generator), torch.randn(1, 1, 3, 4, generator=generator)
    res_k, res_v = torch.randn(1, 1, 2, 4, generator=generator), torch.randn(1, 1, 2, 4, generator=generator)
    log_counts = torch.log(torch.tensor([3.0, 5.0]))
    scale = 0.5
    out = attend_segments(
        query,
        [
            Segment(main_k, main_v, torch.ones(1, 1, 1, 3, dtype=torch.bool)),
            Segment(res_k, res_v, torch.ones(1, 1, 1, 2, dtype=torch.bool), log_counts.view(1, 1, 1, 1, 2)),
        ],
        scale,
    )
    logits = torch.cat([query @ main_k.transpose(-1, -2) * scale, query @ res_k.transpose(-1, -2) * scale + log_counts], dim=-1)
    expected = torch.softmax(logits, dim=-1) @ torch.cat([main_v, res_v], dim=2)
    torch.testing.assert_close(out.transpose(1, 2), expected)


@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("gemma3", "sdpa"), ("qwen2", "eager")])
def test_stored_tokens_and_bytes_follow_the_budget(family, backend):
    model = tiny_model(family, backend)
    prompt = random_prompt(1, 200)
    reference = prefill(model, prompt)
    full_bytes = cache_nbytes(reference)
    replace_for(family)(method="snapkv", max_capacity_prompts=50, window_size=8)
    cache = prefill(model, prompt)
    reports = cache_report(cache)
    for layer, report in zip(cache.layers, reports):
        assert report.tokens_seen == 200
        assert layer.kept_counts.tolist() == [[50] * model.config.num_key_value_heads]
        assert layer.kept_keys.shape[1] == model.config.num_key_value_heads  # GQA: never repeated
    # K/V bytes scale with budget / prompt; the int32 positions add 4 bytes per kept slot.
    head_dim = cache.layers[0].kept_keys.shape[-1]
    position_overhead = 4 / (2 * head_dim * 4)
    assert cache_nbytes(cache) <= full_bytes * 50 / 200 * (1 + position_overhead) + 1024
    assert "3 of 3 layers hold fewer entries than tokens seen" in format_report(reports)


def test_a_second_prompt_is_compressed_too():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8)
    first = model.generate(random_prompt(1, 80, seed=1), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    second = model.generate(random_prompt(1, 120, seed=2), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    for out, length in ((first, 80), (second, 120)):
        reports = cache_report(output_cache(out))
        assert all(r.compressed and r.tokens_seen == length + 2 and r.stored_max == 32 for r in reports)


def test_a_reset_cache_serves_the_next_prompt_from_scratch():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8)
    cache = prefill(model, random_prompt(1, 80))
    cache.reset()
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        model(random_prompt(1, 20), **with_cache(cache))  # within budget: back to a native layer
    assert cache.get_seq_length() == 20
    assert not any(isinstance(layer, CompressedLayer) for layer in cache.layers)


def test_beam_style_reordering_and_cropping_of_the_tail():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded([60, 50])
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8)
    cache = prefill(model, input_ids, attention_mask)
    layer = cache.layers[0]
    kept_row_1 = layer.kept_keys[1].clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].kept_keys[0], kept_row_1)
    with torch.no_grad():
        model(torch.tensor([[5, 6], [7, 8]]), attention_mask=torch.ones(2, 62, dtype=torch.long), **with_cache(cache))
    assert cache.get_seq_length() == 62
    cache.crop(-1)
    assert cache.get_seq_length() == 61 and cache.layers[0].tail_length == 1
    with pytest.raises(RuntimeError, match="only drop tokens appended after compression"):
        cache.crop(-5)


def test_unpatched_forward_refuses_a_compressed_layer():
    layer = CompressedLayer(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.tensor([[[0, 1]]]), tokens_seen=5)
    with pytest.raises(RuntimeError, match="compressed by restkv"):
        layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


# ---------------------------------------------------------------- the fused read path
def _decode_layer(kept: int, heads: int = 2, length: int = 60, dim: int = 8, ragged: bool = False,
                  residual: int = 0, sliding_window: int | None = None, seed: int = 0,
                  readout: ResidualReadout | None = None) -> CompressedLayer:
    """A compressed layer of one row holding ``kept`` of ``length`` prompt tokens per head
    (head 0 one fewer when ``ragged``), with ``residual`` entries in its last slots."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, heads, kept + residual, dim, generator=generator) for _ in range(2))
    columns = torch.stack([torch.sort(torch.randperm(length, generator=generator)[:kept]).values
                           for _ in range(heads)])[None]
    if ragged:
        columns[0, 0, -1] = -1
    columns = torch.nn.functional.pad(columns, (0, residual), value=-1)
    log_counts = None
    if residual:
        log_counts = torch.log(torch.randint(1, 6, (1, heads, residual), generator=generator).float())
        log_counts[0, 0, 0] = float("-inf")  # head 0 holds one entry fewer
    return CompressedLayer(keys, values, columns, tokens_seen=length, sliding_window=sliding_window,
                           residual_log_counts=log_counts, residual_readout=readout)


@pytest.mark.parametrize("case", [
    dict(kept=12), dict(kept=12, ragged=True), dict(kept=40, sliding_window=30),
    dict(kept=12, residual=3, readout=ResidualReadout(gate=False, beta=0.7)),
])
def test_fused_decode_equals_the_segmented_reference(case):
    """SDPA over the joined kept slots and tail gives the segmented softmax's output, step by
    step, for a 3-token chunk then single tokens (dense and ragged storage, sliding window,
    residual entries read with a fixed count bias)."""
    fused, reference = _decode_layer(**case), _decode_layer(**case)
    generator = torch.Generator().manual_seed(1)
    for q_len in (3, 1, 1, 1):
        query = torch.randn(1, 4, q_len, 8, generator=generator)
        key, value = (torch.randn(1, 2, q_len, 8, generator=generator) for _ in range(2))
        ours = fused.attend(query, key, value, None, 0.35)
        expected = reference.attend(query, key, value, None, 0.35, fused=False)
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert fused.tail_length == reference.tail_length and torch.equal(fused.tail[0], reference.tail[0])


def test_fused_decode_does_not_copy_the_kept_entries_each_step():
    """Dense kept entries share one buffer with the tail: a decode step appends in place."""
    layer = _decode_layer(kept=12)
    step = lambda: layer.attend(torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), None, 0.35)
    step()
    pointer, kept = layer.kept_keys.data_ptr(), layer.kept_keys.clone()
    for _ in range(5):  # within the first 16 tail slots
        step()
    assert layer.kept_keys.data_ptr() == pointer and torch.equal(layer.kept_keys, kept)


def test_layers_the_fused_kernel_cannot_express_take_the_segmented_path():
    """The ResKV gate depends on each query's own softmax over the exact entries, and Gemma 2's
    soft-cap transforms the logits: both stay on the reference path."""
    gated = _decode_layer(kept=12, residual=3, readout=ResidualReadout())
    capped = _decode_layer(kept=12)
    query, key, value = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    for layer, softcap in ((gated, None), (capped, 5.0)):
        twin = _decode_layer(kept=12, residual=layer.residual_width, readout=layer.residual_readout)
        torch.testing.assert_close(layer.attend(query, key, value, None, 0.35, softcap),
                                   twin.attend(query, key, value, None, 0.35, softcap, fused=False), rtol=0, atol=0)
