"""Bounded memory for long inputs and long outputs: chunked prefill (--prefill_chunk_size) and
compression during decoding (--decode_budget, --decode_interval), restkv.recompress."""

import pytest
import torch

from restkv import CompressionConfig, ConfigError
from restkv.cache import CompressedLayer
from restkv.compat import output_cache
from restkv.generation import prefill
from tiny_models import (
    assert_patch_reproduces_unpatched,
    assert_rows_match_single_row_runs,
    greedy,
    random_prompt,
    replace_for,
    tiny_model,
)

CHUNKABLE = ["snapkv", "restkv", "h2o", "tova", "l2norm", "streamingllm", "adakv", "pyramidkv", "random"]


def config_is_uniform(method):
    return CompressionConfig(method=method, max_capacity_prompts=20, window_size=4).policy.allocation is None


def kept_sets(cache):
    """What each layer holds: the kept positions of a compressed layer, the keys of a native one."""
    return [layer.kept_columns.clone() if isinstance(layer, CompressedLayer) else layer.keys for layer in cache.layers]


@pytest.mark.parametrize("method", CHUNKABLE)
def test_a_prompt_that_fits_in_one_chunk_is_compressed_exactly_as_in_one_pass(method):
    model = tiny_model("llama")
    prompt = random_prompt(1, 90)
    options = dict(method=method, max_capacity_prompts=24, window_size=8)
    replace_for("llama")(**options)
    single = greedy(model, prompt)
    replace_for("llama")(**options, prefill_chunk_size=90)
    chunked = greedy(model, prompt)
    assert torch.equal(single.sequences, chunked.sequences)
    assert all(torch.equal(a, b) for a, b in zip(single.logits, chunked.logits))
    assert all(torch.equal(a, b) for a, b in zip(kept_sets(output_cache(single)), kept_sets(output_cache(chunked))))


@pytest.mark.parametrize("method", CHUNKABLE)
def test_no_layer_ever_holds_more_than_budget_plus_chunk(method):
    model = tiny_model("llama")
    replace_for("llama")(method=method, max_capacity_prompts=20, window_size=4, prefill_chunk_size=16,
                         l2norm_skip_layers=() if method == "l2norm" else None)
    held = []

    def record(module, args, kwargs, output):
        layer = kwargs["cache"].layers[module.layer_idx]
        held.append(int((layer.kept_columns >= 0).sum()) + 2 * layer.tail_length)  # both KV heads

    handle = model.model.layers[1].self_attn.register_forward_hook(record, with_kwargs=True)
    cache = prefill(model, random_prompt(1, 100))
    handle.remove()
    final = int((cache.layers[1].kept_columns >= 0).sum())  # the layer's budget over its KV heads
    assert len(held) == 7 and max(held) <= final + 2 * 16  # 100 tokens in chunks of 16
    assert all(layer.tokens_seen == 100 for layer in cache.layers)
    if config_is_uniform(method):
        assert final == 2 * 20


def test_chunked_l2norm_keeps_the_lowest_norm_keys_of_the_whole_prompt():
    """Keeping the lowest norms of (kept + chunk) chunk after chunk keeps the prompt's lowest norms.
    Layer 0's keys come from the embeddings alone, so they are the same in both runs (later
    layers read a compressed cache while the prompt is being read)."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 100)
    options = dict(method="l2norm", max_capacity_prompts=20, l2norm_skip_layers=())
    replace_for("llama")(**options)
    single = kept_sets(prefill(model, prompt))
    replace_for("llama")(**options, prefill_chunk_size=24)
    chunked = kept_sets(prefill(model, prompt))
    assert torch.equal(single[0], chunked[0])


def test_chunked_streamingllm_keeps_the_sinks_and_the_last_tokens():
    model = tiny_model("llama")
    replace_for("llama")(method="streamingllm", max_capacity_prompts=20, prefill_chunk_size=16)
    for layer in prefill(model, random_prompt(1, 100)).layers:
        for head in range(2):
            assert layer.kept_columns[0, head].tolist() == [0, 1, 2, 3] + list(range(84, 100))


def test_a_ratio_budget_grows_with_the_tokens_seen():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", compression_ratio=0.75, window_size=4, prefill_chunk_size=32)
    for layer in prefill(model, random_prompt(1, 120)).layers:
        assert layer.kept_counts.tolist() == [[30, 30]]  # floor(120 * 0.25)


def test_decode_budget_at_or_above_the_total_length_changes_nothing():
    model = tiny_model("llama")
    assert_patch_reproduces_unpatched(model, "llama", random_prompt(1, 60), new_tokens=8, method="snapkv",
                                      max_capacity_prompts=200, window_size=4, decode_budget=200,
                                      decode_interval=2)
    prompt = random_prompt(1, 60)
    replace_for("llama")(method="snapkv", max_capacity_prompts=32, window_size=4)
    plain = greedy(model, prompt, new_tokens=8)
    replace_for("llama")(method="snapkv", max_capacity_prompts=32, window_size=4, decode_budget=64,
                         decode_interval=2)
    budgeted = greedy(model, prompt, new_tokens=8)
    assert torch.equal(plain.sequences, budgeted.sequences)
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, budgeted.logits))


def test_a_small_decode_budget_bounds_the_cache_and_keeps_positions_right():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4, decode_budget=20,
                         decode_interval=5)
    stored = []

    def record(module, args, kwargs, output):
        layer = kwargs["cache"].layers[module.layer_idx]
        stored.append((int(layer.kept_counts.max()) + layer.tail_length, layer.tokens_seen,
                       int(layer.kept_columns.max())))

    handle = model.model.layers[0].self_attn.register_forward_hook(record, with_kwargs=True)
    out = model.generate(random_prompt(1, 50), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                         return_dict_in_generate=True)
    handle.remove()
    assert max(count for count, _, _ in stored[1:]) <= 20 + 5
    assert [seen for _, seen, _ in stored] == list(range(50, 80))  # every step's position is the tokens seen
    assert all(newest < seen for _, seen, newest in stored)
    assert output_cache(out).layers[0].tokens_seen == 79


def test_rows_of_a_batch_stay_independent_under_decode_compression():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=20, window_size=4, decode_budget=16,
                         decode_interval=3)
    assert_rows_match_single_row_runs(model, [60, 41, 35], new_tokens=10)


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(method="snapkv", prefill_chunk_size=4), "--prefill_chunk_size 4 must be at least --window_size 8"),
        (dict(method="snapkv", decode_budget=8), "--decode_budget 8 must exceed --window_size 8"),
        (dict(method="h2o", h2o_queries="all", prefill_chunk_size=64), "--h2o_queries all"),
        (dict(method="kvzip", decode_budget=64), "need the whole prompt first"),
        (dict(method="snapkv", observation="reconstruction", prefill_chunk_size=64), "need the whole prompt first"),
        (dict(method="cam", cam_mode="reference", decode_budget=64), "--cam_mode reference"),
        (dict(method="fullkv", decode_budget=64), "--method fullkv evicts nothing"),
    ],
)
def test_settings_that_cannot_compress_as_tokens_come_name_the_flag(options, fragment):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(max_capacity_prompts=32, window_size=8, **options)
    assert fragment in str(error.value)


def test_a_decode_budget_alone_compresses_only_during_generation():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", window_size=4, decode_budget=30, decode_interval=4)
    cache = prefill(model, random_prompt(1, 50))
    assert all(layer.kept_counts.tolist() == [[50, 50]] for layer in cache.layers)  # the prompt is whole
    out = model.generate(random_prompt(1, 50), max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    assert int(output_cache(out).layers[0].kept_counts.max()) + output_cache(out).layers[0].tail_length <= 30 + 4
