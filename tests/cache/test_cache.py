"""The compressed cache: budget, memory, GQA storage, segments, state between prompts."""

import pytest
import torch
from tiny_models import FAMILY_BACKENDS, decode_in_chunks, left_padded, random_prompt, replace_for, tiny_model

from restkv.cache import CompressedLayer, cache_nbytes, cache_report, format_report, kept_positions
from restkv.integrations.transformers.compat import output_cache, with_cache
from restkv.integrations.transformers.generation import prefill


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
        cache.layers[index] = CompressedLayer.from_tokens(keys, values, columns, tokens_seen=length,
                                                          sliding_window=sliding)
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
    assert sum(report.used_nbytes for report in reports) <= full_bytes * 50 / 200 * (1 + position_overhead) + 1024
    # what the buffers hold: the kept tokens and an eighth of them as room for appended ones
    assert cache_nbytes(cache) <= full_bytes * 50 / 200 * (1 + position_overhead) * (1 + 1 / 8) + 1024
    assert "3 of 3 attention layers hold fewer entries than tokens seen" in format_report(reports)


def _allocated_bytes(layer) -> int:
    """Bytes of every distinct storage the layer's segments hold tensors in (what memory really holds)."""
    storages = {}
    for segment in layer.kept:
        for value in vars(segment).values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("new_tokens", [2, 40])
def test_memory_follows_the_budget_through_decoding_and_is_reported_as_allocated(new_tokens):
    """At 64 of 401 tokens the buffers hold at most 1.25x the budget's share of the full cache's bytes (one
    decode step, and forty: the spare room grows with what is held), and ``cache_report`` gives what the
    buffers hold beside what is stored."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 401)
    full = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                          pad_token_id=0)
    full_bytes = cache_nbytes(output_cache(full))
    replace_for("llama")(method="snapkv", max_capacity_prompts=64, window_size=8)
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                         pad_token_id=0)
    cache = output_cache(out)
    seen = 401 + new_tokens - 1
    held_share = (64 + new_tokens - 1) / seen
    for layer, report in zip(cache.layers, cache_report(cache)):
        assert report.nbytes == _allocated_bytes(layer) and report.used_nbytes <= report.nbytes
        assert report.nbytes <= 1.25 * held_share * full_bytes / len(cache.layers)


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


def test_update_hands_the_new_tokens_to_the_steps_read_which_appends_them():
    """transformers' ``update``, with one meaning: the step's new tokens go on as they are to restkv's read of the
    step, which appends them (with their columns) and attends over every segment; tokens no read appended (another
    kernel read the layer) are refused at the next update instead of being lost."""
    keys, values = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    layer = CompressedLayer.from_tokens(keys, values, torch.tensor([[[0, 3]]]), tokens_seen=5)
    new_keys, new_values = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    handed_keys, handed_values = layer.update(new_keys, new_values)
    assert handed_keys is new_keys and handed_values is new_values and layer.get_seq_length() == 5
    output = layer.attend(torch.randn(1, 2, 1, 4), *layer.take_incoming(), None, 0.5)
    assert output.shape == (1, 1, 2, 4) and layer.take_incoming() == (None, None)
    assert layer.get_seq_length() == 6 and layer.kept_columns.tolist() == [[[0, 3]]]
    assert layer.kept_tokens(appended=True)[2].tolist() == [[[0, 3, 5]]]
    layer.update(new_keys, new_values)
    with pytest.raises(RuntimeError, match="its last new tokens were read by another kernel"):
        layer.update(new_keys, new_values)



def test_kept_positions_are_row_local_and_match_the_kept_columns():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded([60, 45])
    replace_for("llama")(method="snapkv", max_capacity_prompts=20, window_size=4)
    cache = prefill(model, input_ids, attention_mask)
    layers = kept_positions(cache)
    assert len(layers) == len(cache.layers)
    for kept, layer in zip(layers, cache.layers):
        for row, length in enumerate((60, 45)):
            for head in range(model.config.num_key_value_heads):
                positions = kept.exact[row][head]
                assert len(positions) == 20 and positions == sorted(positions)
                assert positions[-4:] == list(range(length - 4, length))  # the window, row-local
                columns = layer.kept_columns[row, head]
                padding = 60 - length
                assert positions == sorted((columns[columns >= 0] - padding).tolist())
        assert kept.summaries == [[0, 0], [0, 0]]


def test_kept_positions_count_residual_entries_apart():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4, residual=True,
                         residual_no_validation=True, residual_fixed_ratio=0.25)
    cache = prefill(model, random_prompt(1, 90))
    for kept in kept_positions(cache):
        for head, positions in enumerate(kept.exact[0]):
            assert len(positions) + kept.summaries[0][head] == 24
            assert kept.summaries[0][head] == 6


@pytest.mark.parametrize("method", ["snapkv", "restkv", "adakv", "kvzip"])
def test_a_compressed_prefill_leaves_no_layer_context_alive(method):
    """A layer's queries, keys and window attention are freed once it is compressed: the scoring
    context and its observation once referred to each other, so every layer's stayed in memory
    until the garbage collector ran (single-pass SnapKV then peaked above the full cache)."""
    import gc

    model = tiny_model("llama")
    replace_for("llama")(method=method, max_capacity_prompts=20, window_size=4)
    gc.collect()
    gc.disable()
    try:
        cache = prefill(model, random_prompt(1, 90))
        alive = [obj for obj in gc.get_objects() if type(obj).__name__ in ("LayerInputs", "WindowObservation")]
    finally:
        gc.enable()
    assert isinstance(cache.layers[0], CompressedLayer) and alive == []
