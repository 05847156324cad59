"""ReST-KV (``--method restkv``): config, golden fixtures, oracles on small tensors,
numerics, batches and exactness."""

import argparse
import math

import pytest
import torch
from golden import kept_sets, load_case, reference_kept_sets
from tiny_models import (FAMILY_BACKENDS, assert_patch_reproduces_unpatched, assert_rows_match_single_row_runs,
                         left_padded, random_prompt, replace_for, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import plan_layer
from restkv.policies.restkv import _projected_norms
from restkv.scoring.adaptive_pooling import attention_shift, kernel_and_shift, shifted_replicate_mean
from restkv.scoring.temporal import aggregate_queries
from restkv.scoring.window import window_attention


def random_qkv(batch=1, heads=4, kv_heads=2, length=96, dim=8, hidden=24, seed=0):
    """Random post-RoPE tensors and an output projection ``[hidden, heads * dim]``."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, dim, generator=generator) * 2
    key = torch.randn(batch, kv_heads, length, dim, generator=generator) * 2
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    o_proj = torch.randn(hidden, heads * dim, generator=generator) / math.sqrt(heads * dim)
    return query, key, value, o_proj


def restkv_scores(query, key, value, o_proj_weight=None, scaling=None, **options):
    """The policy's ``[B, H_kv, N]`` scores for an unpadded batch (what ``compress_kv`` ranks)."""
    config = CompressionConfig(method="restkv", **options)
    batch, _, length, dim = query.shape
    plan = plan_layer(config, torch.ones(batch, length, dtype=torch.bool))
    facts = LayerFacts(scaling if scaling is not None else 1 / math.sqrt(dim), o_proj_weight=o_proj_weight)
    ctx = LayerInputs(query, key, value, plan, facts)
    return config.policy.score(ctx)


# ----------------------------------------------------------------------------- oracles
def window_weights(window, temporal, alpha=0.3):
    """Closed-form weight of each window query (oldest first) in the temporal aggregation."""
    if temporal == "mean":
        return torch.full((window,), 1.0 / window)
    if temporal == "none":
        return torch.nn.functional.one_hot(torch.tensor(window - 1), window).float()
    powers = torch.tensor([(1 - alpha) ** (window - 1 - i) for i in range(window)])
    weights = alpha * powers
    weights[0] = (1 - alpha) ** (window - 1)
    return weights if temporal == "ema" else weights.flip(0)


def explicit_window_attention(query, key, window):
    """``[B, H, w, N]`` causal softmax of the last ``w`` queries, KV repeated per query head."""
    groups = query.shape[1] // key.shape[1]
    length = query.shape[2]
    logits = query[:, :, -window:] @ key.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(query.shape[-1])
    future = torch.arange(length)[None, :] > torch.arange(length - window, length)[:, None]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def project(x, o_proj, head_axis_size):
    """``W_o^h x`` in the hidden space for per-head vectors ``x [B, H, ..., d]`` (None: identity)."""
    if o_proj is None:
        return x
    per_head = o_proj.view(o_proj.shape[0], head_axis_size, -1)  # [D, H, d]
    return torch.einsum("bh...d,chd->bh...c", x, per_head)


def explicit_after(query, key, value, o_proj, window, temporal="ema", alpha=0.3, tau=1.0):
    """The release's "after" formula in hidden space, per query head, then the group mean."""
    heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
    values = value.repeat_interleave(heads // kv_heads, 1)[:, :, : length - window]
    attention = explicit_window_attention(query, key, window)[..., : length - window]
    mean_attention = torch.einsum("bhwn,w->bhn", attention, window_weights(window, temporal, alpha))
    mean_output = torch.einsum("bhn,bhnd->bhd", mean_attention, values)
    gaps = (project(mean_output[:, :, None], o_proj, heads) - project(values, o_proj, heads)).norm(dim=-1)
    scores = mean_attention / (1 - mean_attention) * (gaps**tau if o_proj is not None else gaps)
    return scores.view(scores.shape[0], kv_heads, -1, length - window).mean(dim=2)


def explicit_before(query, key, value, o_proj, window, temporal="ema", use_norm=False):
    """The release's "before" formula in hidden space (``[B, H, w, N, D]``: tiny inputs only)."""
    heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
    values = value.repeat_interleave(heads // kv_heads, 1)
    attention = explicit_window_attention(query, key, window)
    outputs = attention @ values
    projected_outputs = project(outputs, o_proj, heads)
    gaps = (projected_outputs[:, :, :, None] - project(values, o_proj, heads)[:, :, None]).norm(dim=-1)
    terms = attention / (1 - attention) * gaps
    if use_norm:
        terms = terms / projected_outputs.norm(dim=-1)[..., None]
    scores = torch.einsum("bhwn,w->bhn", terms, window_weights(window, temporal))[..., : length - window]
    return scores.view(scores.shape[0], kv_heads, -1, length - window).mean(dim=2)


def kept(indices, head=0, row=0):
    return [i for i in indices[row, head].tolist() if i >= 0]


# ----------------------------------------------------------------------------- config
def test_restkv_defaults_are_the_paper_column():
    config = CompressionConfig(method="restkv", max_capacity_prompts=128)
    paper = dict(
        window_size=32, kernel_size=5, pooling="adaptive", use_wo=True, use_ema=True, alpha=0.3,
        metric_mode="after", scale=2000, tau=1.0, use_norm=False, temporal="ema", indicator="reconstruction",
        restkv_mean_output="past_only", restkv_gqa="mean",
    )
    assert {name: getattr(config, name) for name in paper} == paper


def test_other_methods_keep_their_own_pooling_default():
    assert CompressionConfig(method="snapkv", max_capacity_prompts=128).pooling == "avgpool"


def test_replace_derives_defaults_again_but_keeps_explicit_values():
    restkv = CompressionConfig(method="restkv", max_capacity_prompts=128)
    assert restkv.replace(method="snapkv").pooling == "avgpool"
    assert restkv.replace(use_ema=False).temporal == "mean"
    assert restkv.replace(use_wo=False).use_wo is False
    explicit = CompressionConfig(method="restkv", max_capacity_prompts=128, pooling="maxpool", temporal="inv_ema")
    assert explicit.replace(method="snapkv").pooling == "maxpool"
    assert explicit.replace(use_ema=False).temporal == "inv_ema"
    assert CompressionConfig.from_any(restkv.to_dict()) == restkv


def test_the_release_flags_parse_to_the_restkv_config():
    """The paper scripts' flags, and ``--no-`` to turn a default-on boolean off."""
    from restkv.benchmarks.flags import add_compression_flags, compression_config_from_args

    parser = argparse.ArgumentParser()
    add_compression_flags(parser)
    paper = ("--method restkv --max_capacity_prompts 128 --window_size 32 --use_wo --use_ema --alpha 0.3 "
             "--metric_mode after --pooling adaptive --scale 2000 --kernel_size 5")
    assert compression_config_from_args(parser.parse_args(paper.split())) == CompressionConfig(
        method="restkv", max_capacity_prompts=128
    )
    ablation = parser.parse_args("--method restkv --max_capacity_prompts 128 --no-use_wo --no-use_ema".split())
    config = compression_config_from_args(ablation)
    assert (config.use_wo, config.use_ema, config.temporal, config.pooling) == (False, False, "mean", "adaptive")


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(alpha=1.5), "--alpha must lie in [0, 1]"),
        (dict(alpha="0.3"), "--alpha must be a finite number"),
        (dict(tau=0), "--tau must be > 0"),
        (dict(scale=-5), "--scale must be > 0"),
        (dict(kernel_size=1), "--pooling adaptive needs an odd --kernel_size >= 3"),
        (dict(window_size=1, max_capacity_prompts=8), "--pooling adaptive compares the two halves"),
        (dict(metric_mode="middle"), "--metric_mode 'middle' is not allowed"),
        (dict(indicator="attn-v"), "--indicator 'attn-v' is not allowed"),
        (dict(temporal="inv-ema"), "--temporal 'inv-ema' is not allowed"),
        (dict(restkv_mean_output="window"), "--restkv_mean_output"),
        (dict(use_wo="yes"), "--use_wo must be a boolean"),
        (dict(restkv_gqa="vector", metric_mode="before"), "--restkv_gqa vector scores the reconstruction"),
        (dict(restkv_gqa="vector", indicator="attn"), "--restkv_gqa vector scores the reconstruction"),
        (dict(restkv_gqa="vector", tau=2.0), "--restkv_gqa vector takes no exponent"),
    ],
)
def test_invalid_restkv_settings_name_the_flag(options, fragment):
    with pytest.raises(ConfigError) as error:
        CompressionConfig(**{"method": "restkv", "max_capacity_prompts": 64, **options})
    assert fragment in str(error.value)


def test_use_wo_without_an_output_projection_is_a_clear_error():
    query, key, value, _ = random_qkv()
    with pytest.raises(ValueError, match="o_proj_weight"):
        compress_kv(query, key, value, dict(method="restkv", max_capacity_prompts=40, window_size=8))
    with pytest.raises(ValueError, match=r"\[D, 32\]"):
        compress_kv(query, key, value, dict(method="restkv", max_capacity_prompts=40, window_size=8),
                    o_proj_weight=torch.zeros(24, 16))


# ----------------------------------------------------------------------------- golden
GOLDEN_CASES = {
    # The README's flags: --use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive --scale 2000.
    "restkv_readme": dict(method="restkv", max_capacity_prompts=128),
    "restkv_after_avg_nowo": dict(
        method="restkv", max_capacity_prompts=128, pooling="avgpool", use_wo=False, use_ema=False
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_kept_sets_equal_the_release(name):
    """Same kept set per head as the release on CPU in float32.

    The cases are batch 1 and MHA, so the defects the library fixes (row 0's adaptive
    statistic for every row, KV repeated per query head) do not enter; the output-space
    norms go through the Gram matrix instead of the hidden-size projection and still give
    the identical sets.
    """
    case = load_case(name)
    kept_kv = compress_kv(case["query"], case["key"], case["value"], GOLDEN_CASES[name],
                          o_proj_weight=case["o_proj_weight"])
    assert kept_kv.keys.shape == case["key_out"].shape
    assert kept_sets(kept_kv.indices) == reference_kept_sets(case)


# ----------------------------------------------------------------------------- temporal
def test_ema_hand_checked_recursion():
    values = torch.tensor([10.0, 20.0, 30.0])[:, None]  # [w, 1]: oldest first
    assert aggregate_queries(values, "ema", alpha=0.9).item() == pytest.approx(28.9)
    # Reversed: 30, then 0.9 * 20 + 0.1 * 30 = 21, then 0.9 * 10 + 0.1 * 21.
    assert aggregate_queries(values, "inv_ema", alpha=0.9).item() == pytest.approx(11.1)


@pytest.mark.parametrize("temporal", ["mean", "ema", "inv_ema", "none"])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_temporal_weights_match_their_closed_form_and_sum_to_one(temporal, alpha):
    window = 7
    weights = aggregate_queries(torch.eye(window), temporal, alpha)  # response to each query alone
    torch.testing.assert_close(weights, window_weights(window, temporal, alpha))
    assert weights.sum().item() == pytest.approx(1.0)
    constant = torch.full((window, 5), 2.5)
    torch.testing.assert_close(aggregate_queries(constant, temporal, alpha), torch.full((5,), 2.5))


@pytest.mark.parametrize("alpha", [0.3, 0.9])
def test_ema_equals_the_step_by_step_recursion(alpha):
    values = torch.randn(2, 32, 50, generator=torch.Generator().manual_seed(0))
    average = values[:, 0]
    for step in range(1, 32):
        average = alpha * values[:, step] + (1 - alpha) * average
    torch.testing.assert_close(aggregate_queries(values, "ema", alpha), average)


def test_ema_extremes_pick_one_query():
    values = torch.arange(6.0)[:, None]
    assert aggregate_queries(values, "ema", alpha=1.0).item() == 5.0  # newest
    assert aggregate_queries(values, "ema", alpha=0.0).item() == 0.0  # oldest
    assert aggregate_queries(values, "none", alpha=0.3).item() == 5.0


# ----------------------------------------------------------------------------- adaptive pooling
@pytest.mark.parametrize(
    "statistic, kernel, shift",
    [(4100, 5, 2), (-4100, 5, -2), (9000, 9, 4), (0, 5, 1), (-2000, 5, 0), (-2001, 5, -1), (-4000, 5, -1),
     (1999, 5, 0), (-1999, 5, 0)],
)
def test_adaptive_kernel_and_shift_hand_cases(statistic, kernel, shift):
    assert kernel_and_shift(float(statistic), 2000.0, 5) == (kernel, shift)


@pytest.mark.parametrize("kernel, shift", [(5, 0), (5, 2), (5, -2), (9, 4), (9, -3), (7, 1), (13, 6)])
def test_shifted_replicate_mean_equals_the_clamped_formula(kernel, shift):
    scores = torch.randn(3, 11, generator=torch.Generator().manual_seed(kernel + shift))  # 3 heads at once
    pooled = shifted_replicate_mean(scores, kernel, shift)
    half = kernel // 2
    expected = torch.stack([
        torch.stack([scores[:, min(max(j + shift + u, 0), 10)] for u in range(-half, half + 1)]).mean(dim=0)
        for j in range(11)
    ], dim=-1)
    torch.testing.assert_close(pooled, expected)


def test_attention_shift_measures_the_drift_of_the_top_positions():
    """Queries of the first half attend to positions 100..103, of the second half 40..43."""
    weights = torch.full((1, 5, 200), 1e-4)  # w = 5: odd, which the release could not handle
    weights[0, :2, 100:104] = 1.0
    weights[0, 2:, 40:44] = 1.0
    valid = torch.ones(200, dtype=torch.bool)
    assert attention_shift(weights, valid, top=4).tolist() == [pytest.approx(60.0)]
    # Padding is never counted, even where it would win the top-k.
    weights[0, :, 0:4] = 5.0
    valid[0:4] = False
    assert attention_shift(weights, valid, top=4).tolist() == [pytest.approx(60.0)]


def test_attention_shift_equals_the_release_rank_matched_differences_for_even_windows():
    weights = torch.softmax(torch.randn(3, 8, 150, generator=torch.Generator().manual_seed(3)) * 3, dim=-1)
    top = 20
    first = weights[:, :4].sort().indices[..., -top:]
    second = weights[:, 4:].sort().indices[..., -top:]
    release = (first - second).double().mean(dim=(1, 2))
    torch.testing.assert_close(attention_shift(weights, torch.ones(150, dtype=torch.bool), top), release)


def kv_head_kernels(query, key, row, scale, window=8, top=32):
    """(kernel, shift) per KV head of one unpadded row, with the default minimum kernel 5."""
    length = query.shape[2]
    valid = torch.ones(length, dtype=torch.bool)
    attention = window_attention(query, key, valid.expand(query.shape[0], -1), window, 1 / math.sqrt(query.shape[-1]))
    drift = attention_shift(attention[row], valid, top).view(key.shape[1], -1).mean(dim=-1)
    return [kernel_and_shift(statistic, scale, 5) for statistic in drift.tolist()]


def test_adaptive_statistic_is_per_row():
    """Two rows with different drift get different kernels; each equals its own run
    (the release applied row 0's statistic to every row)."""
    query, key, value, o_proj = random_qkv(batch=2, length=120, seed=5)
    config = dict(method="restkv", max_capacity_prompts=40, window_size=8, scale=1.0)
    assert kv_head_kernels(query, key, 0, scale=1.0) != kv_head_kernels(query, key, 1, scale=1.0)
    batched = compress_kv(query, key, value, config, o_proj_weight=o_proj)
    for row in range(2):
        alone = compress_kv(query[row : row + 1], key[row : row + 1], value[row : row + 1], config,
                            o_proj_weight=o_proj)
        assert torch.equal(batched.indices[row], alone.indices[0])


def test_adaptive_pooling_of_restkv_scores_follows_each_kv_heads_kernel():
    query, key, value, o_proj = random_qkv(length=150, seed=2)
    options = dict(max_capacity_prompts=40, window_size=8, scale=0.25)
    raw = restkv_scores(query, key, value, o_proj, pooling="none", **options)
    pooled = restkv_scores(query, key, value, o_proj, pooling="adaptive", **options)
    kernels = kv_head_kernels(query, key, 0, scale=0.25)
    assert len(set(kernels)) == 2 and all(shift != 0 for _, shift in kernels)  # two different, shifted kernels
    for head, (kernel, shift) in enumerate(kernels):
        expected = shifted_replicate_mean(raw[0, head, :142], kernel, shift)
        torch.testing.assert_close(pooled[0, head, :142], expected)


# ----------------------------------------------------------------------------- indicator
def test_indicator_hand_case_four_tokens_one_head():
    """One window query with weights 0.1, 0.2, 0.3, 0.4 (ln-spaced keys, d = 2, scale 1)."""
    query = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2).repeat(1, 1, 4, 1)
    key = torch.tensor([[math.log(i), 0.0] for i in (1, 2, 3, 4)]).view(1, 1, 4, 2)
    value = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [5.0, 5.0]]).view(1, 1, 4, 2)
    scores = restkv_scores(query, key, value, scaling=1.0, max_capacity_prompts=3, window_size=1,
                           pooling="none", use_wo=False)
    # ō = 0.1 v0 + 0.2 v1 + 0.3 v2 = (0.4, 0.5); score = a/(1-a) * ‖ō - v_j‖
    expected = [1 / 9 * math.sqrt(0.61), 0.25 * math.sqrt(0.41), 3 / 7 * math.sqrt(0.61)]
    assert scores[0, 0, :3].tolist() == pytest.approx(expected, rel=1e-5)
    out = compress_kv(query, key, value, dict(method="restkv", max_capacity_prompts=3, window_size=1,
                                              pooling="none", use_wo=False), scaling=1.0)
    assert kept(out.indices) == [1, 2, 3]


@pytest.mark.parametrize("mode", [dict(metric_mode="before"), dict(metric_mode="after", restkv_mean_output="full")])
def test_single_query_score_is_the_output_change_from_deleting_the_token(mode):
    """W = 1, one head, tau = 1, no pooling: score_j = ‖W_o (o - o^(-j))‖ with o^(-j) the
    attention output recomputed without key j."""
    query, key, value, o_proj = random_qkv(heads=1, kv_heads=1, length=30, seed=4)
    scores = restkv_scores(query, key, value, o_proj, max_capacity_prompts=10, window_size=1, pooling="none", **mode)
    query, key, value, o_proj = (t.double() for t in (query, key, value, o_proj))  # the oracle cancels: float64
    logits = key[0, 0] @ query[0, 0, -1] / math.sqrt(8)
    output = torch.softmax(logits, 0) @ value[0, 0]
    for j in range(29):
        others = torch.arange(30) != j
        without = torch.softmax(logits[others], 0) @ value[0, 0, others]
        change = o_proj @ (output - without)
        assert scores[0, 0, j].item() == pytest.approx(change.norm().item(), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("temporal", ["ema", "mean", "none", "inv_ema"])
@pytest.mark.parametrize("use_wo", [True, False])
def test_after_mode_equals_the_explicit_hidden_space_formula_under_gqa(temporal, use_wo):
    query, key, value, o_proj = random_qkv(seed=1)
    ours = restkv_scores(query, key, value, o_proj, max_capacity_prompts=40, window_size=8, pooling="none",
                         temporal=temporal, use_wo=use_wo, tau=1.5)
    expected = explicit_after(query, key, value, o_proj if use_wo else None, 8, temporal, tau=1.5)
    torch.testing.assert_close(ours[..., :88], expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("use_norm", [False, True])
@pytest.mark.parametrize("use_wo", [True, False])
def test_before_mode_equals_the_explicit_hidden_space_formula_under_gqa(use_wo, use_norm):
    query, key, value, o_proj = random_qkv(length=40, seed=6)
    ours = restkv_scores(query, key, value, o_proj, max_capacity_prompts=16, window_size=6, pooling="none",
                         metric_mode="before", use_wo=use_wo, use_norm=use_norm)
    expected = explicit_before(query, key, value, o_proj if use_wo else None, 6, "ema", use_norm)
    torch.testing.assert_close(ours[..., :34], expected, rtol=1e-4, atol=1e-6)


def test_gram_route_equals_the_explicit_projection_in_float64():
    generator = torch.Generator().manual_seed(7)
    vectors = torch.randn(3, 50, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(_projected_norms(vectors, weight.T @ weight), (vectors @ weight.T).norm(dim=-1))


@pytest.mark.parametrize("mode", [dict(), dict(metric_mode="before")])
def test_orthonormal_output_projection_equals_value_space(mode):
    query, key, value, _ = random_qkv(length=60, seed=8)
    blocks = [torch.linalg.qr(torch.randn(24, 8, generator=torch.Generator().manual_seed(h)))[0] for h in range(4)]
    o_proj = torch.cat(blocks, dim=1)  # each head's columns orthonormal: ‖W_o^h x‖ = ‖x‖
    options = dict(max_capacity_prompts=20, window_size=8, pooling="none", **mode)
    with_wo = restkv_scores(query, key, value, o_proj, use_wo=True, **options)
    without = restkv_scores(query, key, value, use_wo=False, **options)
    torch.testing.assert_close(with_wo[..., :52], without[..., :52], rtol=1e-4, atol=1e-7)


def test_vector_gqa_mode_is_the_norm_of_the_groups_summed_change():
    query, key, value, o_proj = random_qkv(seed=9)
    ours = restkv_scores(query, key, value, o_proj, max_capacity_prompts=40, window_size=8, pooling="none",
                         restkv_gqa="vector")
    values = value.repeat_interleave(2, 1)[:, :, :88]
    attention = explicit_window_attention(query, key, 8)[..., :88]
    mean_attention = torch.einsum("bhwn,w->bhn", attention, window_weights(8, "ema"))
    mean_output = torch.einsum("bhn,bhnd->bhd", mean_attention, values)
    changes = project(values - mean_output[:, :, None], o_proj, 4) * (mean_attention / (1 - mean_attention))[..., None]
    expected = changes.view(1, 2, 2, 88, -1).sum(dim=2).norm(dim=-1)
    torch.testing.assert_close(ours[..., :88], expected, rtol=1e-4, atol=1e-7)


def test_vector_gqa_mode_equals_the_mean_mode_without_groups():
    query, key, value, o_proj = random_qkv(heads=2, kv_heads=2, seed=10)
    options = dict(max_capacity_prompts=40, window_size=8, pooling="none")
    vector = restkv_scores(query, key, value, o_proj, restkv_gqa="vector", **options)
    mean = restkv_scores(query, key, value, o_proj, **options)
    torch.testing.assert_close(vector[..., :88], mean[..., :88], rtol=1e-4, atol=1e-7)


def test_gqa_with_identical_queries_and_output_heads_in_a_group_equals_its_mha_collapse():
    query, key, value, o_proj = random_qkv(heads=2, kv_heads=2, seed=11)
    grouped_query = query.repeat_interleave(2, dim=1)
    grouped_o_proj = o_proj.view(24, 2, 1, 8).expand(24, 2, 2, 8).reshape(24, 32)
    config = dict(method="restkv", max_capacity_prompts=40, window_size=8)
    mha = compress_kv(query, key, value, config, o_proj_weight=o_proj)
    gqa = compress_kv(grouped_query, key, value, config, o_proj_weight=grouped_o_proj)
    assert torch.equal(mha.indices, gqa.indices)


def test_attn_indicator_with_mean_and_avgpool_is_snapkv():
    """The paper's "attn, no smoothing" row: the release always summed and avg-pooled (k = 5)."""
    query, key, value, _ = random_qkv(seed=12)
    restkv = compress_kv(query, key, value, dict(method="restkv", max_capacity_prompts=40, window_size=8,
                                                 indicator="attn", temporal="mean", pooling="avgpool"))
    snapkv = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=40, window_size=8))
    assert torch.equal(restkv.indices, snapkv.indices)


@pytest.mark.parametrize("temporal", ["none", "ema"])
def test_attn_v_indicator_is_aggregated_attention_times_value_norm(temporal):
    query, key, value, _ = random_qkv(seed=13)
    ours = restkv_scores(query, key, value, max_capacity_prompts=40, window_size=8, pooling="none",
                         indicator="attn_v", temporal=temporal)
    attention = torch.einsum("bhwn,w->bhn", explicit_window_attention(query, key, 8), window_weights(8, temporal))
    expected = (attention * value.norm(dim=-1).repeat_interleave(2, 1)).view(1, 2, 2, 96).mean(dim=2)
    torch.testing.assert_close(ours[..., :88], expected[..., :88], rtol=1e-5, atol=1e-8)


def test_adaptive_pooling_is_available_to_other_scorers():
    """``--pooling adaptive`` smooths SnapKV's scores the same way as ReST-KV's attn indicator."""
    query, key, value, _ = random_qkv(length=150, seed=2)
    options = dict(max_capacity_prompts=40, window_size=8, pooling="adaptive", scale=0.25)
    snapkv = compress_kv(query, key, value, dict(method="snapkv", **options))
    restkv = compress_kv(query, key, value, dict(method="restkv", indicator="attn", temporal="mean", **options))
    assert torch.equal(snapkv.indices, restkv.indices)


def test_random_indicator_keeps_what_the_random_control_keeps():
    query, key, value, _ = random_qkv(seed=14)
    options = dict(max_capacity_prompts=40, window_size=8, seed=3)
    restkv = compress_kv(query, key, value, dict(method="restkv", indicator="random", **options))
    control = compress_kv(query, key, value, dict(method="random", **options))
    assert torch.equal(restkv.indices, control.indices)


@pytest.mark.parametrize("allocation", [dict(allocation="adakv"), dict(use_pyramid=True)])
def test_scores_compose_with_head_and_layer_allocations(allocation):
    """Scores are per KV head and comparable across heads and layers, so any allocation applies."""
    query, key, value, o_proj = random_qkv(length=200, seed=17)
    config = dict(method="restkv", max_capacity_prompts=40, window_size=8, **allocation)
    kept_counts = []
    for layer in (0, 7):
        out = compress_kv(query, key, value, config, layer, 8, o_proj)
        counts = (out.indices[0] >= 0).sum(dim=-1)
        kept_counts.append(counts.tolist())
        for head in range(2):
            assert set(range(192, 200)) <= set(kept(out.indices, head))
    if "allocation" in allocation:  # AdaKV: heads share the layer's candidates
        assert all(sum(counts) - 2 * 8 == 2 * 32 for counts in kept_counts)
    else:  # PyramidKV: early layers keep more than the budget, late layers less
        assert min(kept_counts[0]) > 40 > max(kept_counts[1])


# ----------------------------------------------------------------------------- numerics
ONE_HOT_MODES = [
    dict(),
    dict(use_wo=False),
    dict(restkv_mean_output="full"),
    dict(metric_mode="before"),
    dict(metric_mode="before", use_wo=False, use_norm=True),
    dict(restkv_gqa="vector"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ONE_HOT_MODES)
def test_one_hot_attention_gives_finite_scores_and_keeps_its_token(dtype, mode):
    """Every window query puts all its weight on token 17 (the weight rounds to exactly 1):
    without the clamp the odds ratio is inf and the score NaN."""
    query, key, value, o_proj = random_qkv(length=60, dim=16, seed=15)
    direction = torch.nn.functional.normalize(torch.randn(16, generator=torch.Generator().manual_seed(1)), dim=0)
    key[:, :, 17] = 100 * direction
    query[:, :, -8:] = 10 * direction
    query, key, value, o_proj = (t.to(dtype) for t in (query, key, value, o_proj))
    attention = window_attention(query, key, torch.ones(1, 60, dtype=torch.bool), 8, 0.25)
    assert bool((attention[..., 17] == 1).all())
    options = dict(max_capacity_prompts=20, window_size=8, **mode)
    scores = restkv_scores(query, key, value, o_proj, **options)
    assert bool(torch.isfinite(scores).all())
    assert scores.dtype == torch.float32
    out = compress_kv(query, key, value, dict(method="restkv", **options), o_proj_weight=o_proj)
    for head in range(2):
        assert 17 in kept(out.indices, head)


# ----------------------------------------------------------------------------- batches
BATCH_MODES = [
    dict(scale=1.0),
    dict(metric_mode="before", use_norm=True, scale=1.0),
    dict(restkv_gqa="vector", restkv_mean_output="full"),
    dict(indicator="attn_v", temporal="none", pooling="maxpool"),
    dict(use_wo=False, use_ema=False, pooling="avgpool", tau=2.0),
]


@pytest.mark.parametrize("mode", BATCH_MODES)
def test_left_padded_rows_equal_their_single_row_runs(mode):
    lengths = [120, 90, 33]
    query, key, value, o_proj = random_qkv(batch=3, length=120, seed=16)
    mask = torch.zeros(3, 120, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 120 - length :] = 1
    config = dict(method="restkv", max_capacity_prompts=40, window_size=8, **mode)
    batched = compress_kv(query, key, value, config, attention_mask=mask, o_proj_weight=o_proj)
    for row, length in enumerate(lengths):
        alone = compress_kv(query[row : row + 1, :, -length:], key[row : row + 1, :, -length:],
                            value[row : row + 1, :, -length:], config, o_proj_weight=o_proj)
        width = alone.indices.shape[-1]
        assert torch.equal(batched.indices[row, :, :width], alone.indices[0])
        assert bool((batched.indices[row, :, width:] == -1).all())
        assert torch.equal(batched.keys[row, :, :width], alone.keys[0])


# ----------------------------------------------------------------------------- models
@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("batch", ["single", "left_padded_3"])
def test_budget_at_or_above_prompt_reproduces_unpatched_outputs(family, backend, batch):
    model = tiny_model(family, backend)
    input_ids, attention_mask = (random_prompt(1, 70), None) if batch == "single" else left_padded([70, 52, 31])
    assert_patch_reproduces_unpatched(model, family, input_ids, attention_mask, method="restkv",
                                      max_capacity_prompts=70, window_size=8)


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_model_rows_of_a_left_padded_batch_equal_their_single_row_runs(family, backend):
    model = tiny_model(family, backend)
    replace_for(family)(method="restkv", max_capacity_prompts=24, window_size=8, scale=1.0)
    batched = assert_rows_match_single_row_runs(model, [90, 64, 41])
    assert batched.past_key_values.layers[0].kept_counts.tolist() == [[24] * model.config.num_key_value_heads] * 3


def test_the_query_agnostic_preset_is_restkv_under_reconstruction_ranked_model_wide_without_pooling():
    """--method restkv_recon keeps exactly what its options spelled out on --method restkv keep."""
    from restkv.cache import kept_positions
    from restkv.integrations.transformers.generation import prefill

    preset = CompressionConfig(method="restkv_recon", compression_ratio=0.8)
    assert (preset.run.observation, preset.run.allocation, preset.policy.pooling) == (
        "reconstruction", "model_ranked", "none")
    model, prompt = tiny_model("llama"), random_prompt(1, 200)
    kept = []
    for options in ({"method": "restkv_recon"}, {"method": "restkv", "observation": "reconstruction",
                                                 "allocation": "model_ranked", "pooling": "none"}):
        replace_for("llama")(compression_ratio=0.8, **options)
        kept.append([layer.exact for layer in kept_positions(prefill(model, prompt, context_span=(4, 200)))])
    assert kept[0] == kept[1]
    assert CompressionConfig(method="restkv_recon", compression_ratio=0.8, pooling="adaptive").policy.pooling == (
        "adaptive")
