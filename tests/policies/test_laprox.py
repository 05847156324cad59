"""LaProx (restkv.policies.laprox): the output-aware score, layer normalisation and the
model-wide selection."""

import math

import pytest
import torch
from tiny_models import (assert_patch_reproduces_unpatched, assert_rows_match_single_row_runs, greedy, random_prompt,
                         random_qkv, replace_for, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.allocations.laprox import LaProxAllocation
from restkv.cache import cache_report, format_report
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.generation import prefill
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import plan_layer


def scores_of(query, key, value, o_proj, **options):
    """LaProx's ``[B, H_kv, N]`` scores of one layer (window 2 unless given, no pooling, no normalisation)."""
    options = {"window_size": 2, "max_capacity_prompts": 4, "pooling": "none", "laprox_norm": "none", **options}
    config = CompressionConfig(method="laprox", **options)
    valid = torch.ones(query.shape[0], key.shape[2], dtype=torch.bool)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid), LayerFacts(1.0 / math.sqrt(query.shape[-1]), o_proj_weight=o_proj))
    return config.policy.score(ctx), ctx


def explicit_attention(query, key, window):
    """``[H, w, N]`` causal softmax of the last ``w`` queries of row 0, in float64 (one query head per
    KV head group ``h // G``)."""
    heads, length = query.shape[1], key.shape[2]
    groups = heads // key.shape[1]
    scale = 1.0 / math.sqrt(query.shape[-1])
    weights = torch.zeros(heads, window, length, dtype=torch.float64)
    for h in range(heads):
        for row, i in enumerate(range(length - window, length)):
            logits = torch.tensor([scale * float(query[0, h, i] @ key[0, h // groups, j]) for j in range(i + 1)],
                                  dtype=torch.float64)
            weights[h, row, : i + 1] = torch.softmax(logits, dim=0)
    return weights


# ---------------------------------------------------------------- the score
def test_score_is_the_group_mean_of_column_norm_times_projected_value_norm_on_a_hand_case():
    query, key, value = random_qkv(batch=1, heads=2, kv_heads=1, length=6, dim=2, seed=4)
    o_proj = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.5, 0.0, 3.0, 1.0], [0.0, -1.0, 1.0, 2.0]])  # D = 3, H d = 4
    scores, _ = scores_of(query, key, value, o_proj)
    weights = explicit_attention(query, key, 2)
    for j in range(6):
        per_head = []
        for h in range(2):
            projected = o_proj[:, 2 * h : 2 * h + 2].double() @ value[0, 0, j].double()
            per_head.append(weights[h, :, j].norm() * projected.norm())
        assert float(scores[0, 0, j]) == pytest.approx(float(sum(per_head) / 2), rel=1e-5)


def test_one_query_head_per_kv_head_makes_the_cross_head_score_the_square_of_the_default():
    query, key, value = random_qkv(batch=1, heads=2, kv_heads=2, length=20, dim=4, seed=2)
    o_proj = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    plain, _ = scores_of(query, key, value, o_proj)
    squared, _ = scores_of(query, key, value, o_proj, laprox_cross_heads=True)
    torch.testing.assert_close(squared, plain.square(), rtol=1e-5, atol=1e-9)


def test_cross_head_score_is_the_frobenius_norm_of_the_group_term():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=12, dim=4, seed=5)
    o_proj = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    scores, ctx = scores_of(query, key, value, o_proj, laprox_cross_heads=True, window_size=3)
    weights = ctx.window_attention()  # [1, 4, 3, 12]
    for k in range(2):
        for j in range(12):
            term = sum(torch.outer(weights[0, h, :, j], o_proj[:, 4 * h : 4 * h + 4] @ value[0, k, j])
                       for h in (2 * k, 2 * k + 1))
            assert float(scores[0, k, j]) == pytest.approx(float(term.square().sum()), rel=1e-4, abs=1e-9)


def test_layer_sum_normalises_each_rows_candidate_scores_to_one():
    query, key, value = random_qkv(batch=2, heads=4, kv_heads=2, length=30, dim=4, seed=3)
    o_proj = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    raw, ctx = scores_of(query, key, value, o_proj, pooling="avgpool", kernel_size=7)
    normalised, _ = scores_of(query, key, value, o_proj, pooling="avgpool", kernel_size=7, laprox_norm="layer_sum")
    candidates = ctx.candidates[:, None, :].expand_as(raw)
    sums = normalised.masked_fill(~candidates, 0).sum(dim=(1, 2))
    torch.testing.assert_close(sums, torch.ones(2))
    ratio = normalised[candidates] / raw[candidates]
    assert torch.allclose(ratio.view(2, -1), ratio.view(2, -1)[:, :1].expand(2, -1))  # one factor per row


def test_output_energy_normalisation_divides_by_the_window_output_energy():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=16, dim=4, seed=6)
    o_proj = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    raw, ctx = scores_of(query, key, value, o_proj)
    energy_scores, _ = scores_of(query, key, value, o_proj, laprox_norm="output_energy")
    weights = ctx.window_attention()[0]  # [H, w, N]
    heads = torch.stack([weights[h] @ value[0, h // 2] for h in range(4)])  # [H, w, d]
    output = sum(heads[h] @ o_proj[:, 4 * h : 4 * h + 4].T for h in range(4))
    torch.testing.assert_close(energy_scores, raw / output.square().sum())


def test_scores_without_an_output_projection_are_an_error():
    query, key, value = random_qkv(length=40, dim=8)
    with pytest.raises(ValueError, match="o_proj_weight"):
        compress_kv(query, key, value, dict(method="laprox", max_capacity_prompts=16, window_size=4))


# ---------------------------------------------------------------- the selection
def test_with_one_layer_and_one_head_the_model_wide_selection_is_the_heads_top_k():
    query, key, value = random_qkv(heads=2, kv_heads=1, length=60, dim=8, seed=7)
    o_proj = torch.randn(16, 16, generator=torch.Generator().manual_seed(4))
    options = dict(method="laprox", max_capacity_prompts=20, window_size=4)
    wide = compress_kv(query, key, value, options, o_proj_weight=o_proj)
    uniform = compress_kv(query, key, value, {**options, "laprox_alloc": "uniform"}, o_proj_weight=o_proj)
    assert torch.equal(wide.indices, uniform.indices)


def model_counts(model, prompt, **options):
    replace_for("llama")(method="laprox", **options)
    cache = prefill(model, prompt)
    return torch.stack([layer.kept_counts[0] for layer in cache.layers]), cache  # [layers, KV heads]


def test_model_wide_selection_keeps_exactly_the_model_wide_budget_spread_over_layers_and_heads():
    model = tiny_model("llama", num_hidden_layers=4)
    counts, cache = model_counts(model, random_prompt(1, 90), max_capacity_prompts=20, window_size=4)
    assert int(counts.sum()) == 4 * 2 * 20
    assert len(set(counts.sum(dim=1).tolist())) > 1  # layers keep different totals
    assert bool((counts >= 4).all())  # the window stays in every head
    reports = cache_report(cache)
    assert [round(r.stored_mean * 2) for r in reports] == counts.sum(dim=1).tolist()
    assert "4 of 4 attention layers" in format_report(reports)


def test_layer_allocation_keeps_each_layers_total_and_uniform_each_heads():
    model = tiny_model("llama", num_hidden_layers=4)
    prompt = random_prompt(1, 90)
    layer, _ = model_counts(model, prompt, max_capacity_prompts=20, window_size=4, laprox_alloc="layer")
    assert layer.sum(dim=1).tolist() == [40] * 4
    uniform, _ = model_counts(model, prompt, max_capacity_prompts=20, window_size=4, laprox_alloc="uniform")
    assert uniform.flatten().tolist() == [20] * 8


@pytest.mark.parametrize("floor", [0.5, 1.0])
def test_the_floor_gives_every_head_its_share_first_and_keeps_the_total(floor):
    model = tiny_model("llama", num_hidden_layers=4)
    counts, _ = model_counts(model, random_prompt(1, 90), max_capacity_prompts=20, window_size=4,
                             laprox_floor=floor)
    assert int(counts.sum()) == 4 * 2 * 20
    assert bool((counts >= 4 + int(floor * 16)).all())
    if floor == 1.0:
        assert counts.flatten().tolist() == [20] * 8


def test_the_floor_reserves_each_heads_own_top_candidates():
    allocation = LaProxAllocation(laprox_floor=0.5)
    assert allocation.reserved(16) == 8 and LaProxAllocation().reserved(16) == 0


# ---------------------------------------------------------------- contracts
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_budget_at_or_above_the_prompt_reproduces_the_unpatched_model(backend):
    model = tiny_model("llama", backend)
    assert_patch_reproduces_unpatched(model, "llama", random_prompt(1, 60), method="laprox", max_capacity_prompts=80,
                                      window_size=8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family):
    model = tiny_model(family)
    replace_for(family)(method="laprox", max_capacity_prompts=24, window_size=8)
    batched = assert_rows_match_single_row_runs(model, [90, 64, 41])
    counts = torch.stack([layer.kept_counts for layer in output_cache(batched).layers])  # [layers, B, H_kv]
    assert counts.sum(dim=(0, 2)).tolist() == [3 * 2 * 24] * 3  # every row keeps the model-wide total


def test_runs_repeat_bit_for_bit():
    model = tiny_model("llama")
    prompt = random_prompt(1, 80)
    replace_for("llama")(method="laprox", max_capacity_prompts=20, window_size=4)
    first, second = greedy(model, prompt), greedy(model, prompt)
    assert torch.equal(first.sequences, second.sequences)
    for a, b in zip(output_cache(first).layers, output_cache(second).layers):
        assert torch.equal(a.kept_columns, b.kept_columns) and torch.equal(a.kept_keys, b.kept_keys)


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(laprox_alloc="heads"), "--laprox_alloc"),
        (dict(laprox_norm="energy"), "--laprox_norm"),
        (dict(laprox_floor=1.5), "--laprox_floor"),
        (dict(allocation="adakv"), "own laprox allocation"),
        (dict(kernel_size=4), "--kernel_size"),
        # Each of these once passed the config, ran the prefill and the whole reconstruction pass, then raised.
        (dict(observation="reconstruction", window_size=8),
         "--method laprox scores with each window query's own attention row"),
        (dict(observation="reconstruction", laprox_alloc="uniform", window_size=8), "--observation reconstruction"),
        (dict(observation="reconstruction", laprox_cross_heads=True, window_size=8), "--observation reconstruction"),
        (dict(prefill_chunk_size=64, window_size=8),
         "--method laprox's model-wide laprox allocation needs the whole prompt"),
    ],
)
def test_bad_settings_name_the_flag(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(method="laprox", max_capacity_prompts=32, **options)


def test_defaults_follow_the_re_implementation():
    config = CompressionConfig(method="laprox", max_capacity_prompts=64)
    assert (config.pooling, config.kernel_size, config.gqa_score_agg, config.window_size) == ("avgpool", 7, "mean", 32)
    assert (config.laprox_norm, config.laprox_cross_heads, config.laprox_floor) == ("layer_sum", False, 0.0)
    assert config.run.allocation == "laprox" and config.compresses_after_prefill
