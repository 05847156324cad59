"""Merging evicted tokens: LOOK-M pivot merge (--merge pivot, any scorer), kvpress' MergingPress
(--merge similarity) and CaM (paper and
reference modes), against oracles written as loops; exactness and batch invariance."""

import math

import pytest
import torch
from tiny_models import (FAMILY_BACKENDS, assert_patch_reproduces_unpatched, assert_rows_match_single_row_runs,
                         left_padded, random_qkv, registered_methods, replace_for, rope_tables, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.merges.cam import cam_merge, cam_reference_values
from restkv.merges.evicted import kept_mask
from restkv.merges.pivot import pivot_merge

#: an output projection for the scorers that read one (``[hidden, heads * dim]`` of ``random_qkv()``)
O_PROJ = torch.randn(32, 4 * 16, generator=torch.Generator().manual_seed(1))


def one_head(columns):
    """``[1, 1, K]`` column tensor from a list."""
    return torch.tensor([[columns]])


def gather(tensor, columns):
    return tensor[:, :, columns.clamp(min=0)[0, 0]]


# ---------------------------------------------------------------- pivot merge
def test_pivot_merge_without_evicted_tokens_is_the_identity():
    _, key, value = random_qkv(length=10)
    columns = torch.arange(10).expand(1, 2, 10)
    keys, values = key.clone(), value.clone()
    merged_keys, merged_values = pivot_merge(key, value, torch.zeros(1, 2, 10, dtype=torch.bool), columns, keys, values)
    assert torch.equal(merged_keys, key) and torch.equal(merged_values, value)


def test_pivot_merge_of_a_token_equal_to_its_pivot_changes_nothing():
    _, key, value = random_qkv(kv_heads=1, length=6)
    key[0, 0, 5], value[0, 0, 5] = key[0, 0, 2], value[0, 0, 2]  # token 5 duplicates kept token 2
    columns = one_head([0, 2, 4])
    evicted = torch.tensor([[[False, False, False, False, False, True]]])
    merged_keys, merged_values = pivot_merge(key, value, evicted, columns, gather(key, columns), gather(value, columns))
    torch.testing.assert_close(merged_keys, gather(key, columns), rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_values, gather(value, columns), rtol=0, atol=1e-6)


def test_pivot_merge_hand_case_keeps_keys_and_values_aligned():
    """Kept keys along x and y; evicted key 2 points mostly along y, so it merges into kept
    token 1 (keys and values alike): k_1 <- (k_1 + (k_e + k_1)/2) / 2; token 0 is untouched."""
    key = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [0.2, 3.0]]]])
    value = torch.tensor([[[[10.0, 0.0], [0.0, 10.0], [4.0, 4.0]]]])
    columns = one_head([0, 1])
    evicted = torch.tensor([[[False, False, True]]])
    keys, values = pivot_merge(key, value, evicted, columns, key[:, :, :2], value[:, :, :2])
    torch.testing.assert_close(keys[0, 0], torch.tensor([[1.0, 0.0], [(0.0 + 0.1) / 2, (1.0 + 2.0) / 2]]))
    torch.testing.assert_close(values[0, 0], torch.tensor([[10.0, 0.0], [(0.0 + 2.0) / 2, (10.0 + 7.0) / 2]]))


def test_pivot_merge_mean_reduces_several_tokens_into_one_pivot_and_breaks_ties_low():
    key = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]]])  # all parallel: cosine ties
    value = torch.tensor([[[[1.0], [5.0], [2.0], [4.0]]]])
    columns = one_head([0, 1])
    evicted = torch.tensor([[[False, False, True, True]]])
    keys, values = pivot_merge(key, value, evicted, columns, key[:, :, :2], value[:, :, :2])
    # Both evicted tokens pick slot 0 (lowest position among equal cosines).
    torch.testing.assert_close(values[0, 0, :, 0], torch.tensor([(1.0 + (2 + 1) / 2 + (4 + 1) / 2) / 3, 5.0]))
    torch.testing.assert_close(keys[0, 0, :, 0], torch.tensor([(1.0 + (2 + 1) / 2 + (3 + 1) / 2) / 3, 1.0]))


def test_merge_pivot_applies_to_any_scorer_after_selection():
    query, key, value = random_qkv(length=80, seed=3)
    for method in registered_methods(uniform=True, keeps_inputs=True, compresses_first_layer=True):
        base = compress_kv(query, key, value, dict(method=method, max_capacity_prompts=30, window_size=8),
                           o_proj_weight=O_PROJ, rotary=rope_tables(query))
        merged = compress_kv(query, key, value, dict(method=method, max_capacity_prompts=30, window_size=8,
                                                     merge="pivot"), o_proj_weight=O_PROJ, rotary=rope_tables(query))
        assert torch.equal(base.indices, merged.indices)
        assert not torch.equal(base.keys, merged.keys) and not torch.equal(base.values, merged.values)
        evicted = torch.ones(1, 2, 80, dtype=torch.bool) & ~kept_mask(base.indices, 80)
        expected = pivot_merge(key, value, evicted, base.indices, base.keys, base.values)
        torch.testing.assert_close(merged.keys, expected[0])
        torch.testing.assert_close(merged.values, expected[1])


def test_merge_flag_is_validated():
    with pytest.raises(ConfigError, match="--merge 'mean'"):
        CompressionConfig(method="snapkv", max_capacity_prompts=64, merge="mean")
    with pytest.raises(ConfigError, match="--cam_mode"):
        CompressionConfig(method="cam", max_capacity_prompts=64, cam_mode="kvpress")
    with pytest.raises(ConfigError, match="--cam_merge_tokens"):
        CompressionConfig(method="cam", max_capacity_prompts=64, cam_merge_tokens=0)
    for threshold in (5.0, -1.5):  # a cosine lies in [-1, 1]
        with pytest.raises(ConfigError, match=rf"--merge_similarity_threshold must lie in \[-1, 1\]; got {threshold}"):
            CompressionConfig(method="snapkv", max_capacity_prompts=64, merge="similarity",
                              merge_similarity_threshold=threshold)
    CompressionConfig(method="snapkv", max_capacity_prompts=64, merge="similarity", merge_similarity_threshold=-1)


# ---------------------------------------------------------------- CaM, paper semantics
def cam_oracle(value, evicted, columns, values, attention, m, draws):
    """Direct loops over heads and evicted tokens (the CaM paper's semantics)."""
    out = values.clone().double()
    for b in range(value.shape[0]):
        for h in range(value.shape[1]):
            kept = [c for c in columns[b, h].tolist() if c >= 0]
            for e in torch.nonzero(evicted[b, h]).flatten().tolist():
                targets = [slot for slot, c in enumerate(kept) if c > e][:m]
                if not targets:
                    continue
                mean = sum(float(attention[b, h, kept[t]]) for t in targets) / len(targets)
                ratio = float(attention[b, h, e]) / mean if mean > 0 else (math.inf if attention[b, h, e] > 0 else 0.0)
                probability = min(max(ratio, 0.0), 1.0)
                z = probability if draws is None else float(float(draws[b, h, e]) < probability)
                for t in targets:
                    out[b, h, t] += z * value[b, h, e].double() / len(targets)
    return out.to(values.dtype)


def test_cam_one_evicted_token_adds_its_value_over_the_next_kept_ones():
    value = torch.arange(8.0).view(1, 1, 8, 1) + 1.0
    columns = one_head([0, 1, 3, 4, 6])
    evicted = ~kept_mask(columns, 8)
    evicted[0, 0, 5] = evicted[0, 0, 7] = False  # only token 2 is merged
    attention = torch.ones(1, 1, 8)
    kept_values = gather(value, columns)
    merged = cam_merge(value, evicted, columns, kept_values, attention, 2, torch.zeros(1, 1, 8))
    # v_2 = 3 goes to the first two kept tokens after position 2 (slots of 3 and 4): +1.5 each.
    assert (merged - kept_values)[0, 0, :, 0].tolist() == [0.0, 0.0, 1.5, 1.5, 0.0]
    wide = cam_merge(value, evicted, columns, kept_values, attention, 32, torch.zeros(1, 1, 8))
    assert (wide - kept_values)[0, 0, :, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]  # |T_e| = 3 kept after it


def test_cam_without_attention_on_evicted_tokens_keeps_the_base_values():
    query, key, value = random_qkv(length=50)
    columns = torch.tensor([[[0, 5, 9, 20, 33, 49]] * 2])
    attention = torch.rand(1, 2, 50)
    evicted = ~kept_mask(columns, 50)
    attention[evicted] = 0.0
    kept_values = value.gather(2, columns[..., None].expand(-1, -1, -1, 16))
    assert torch.equal(cam_merge(value, evicted, columns, kept_values, attention, 4, None), kept_values)
    assert torch.equal(cam_merge(value, evicted, columns, kept_values, attention, 4, torch.rand(1, 2, 50)), kept_values)


@pytest.mark.parametrize("expected", [True, False])
@pytest.mark.parametrize("merge_tokens", [1, 3, 32])
def test_cam_paper_merge_equals_the_direct_oracle(expected, merge_tokens):
    generator = torch.Generator().manual_seed(merge_tokens)
    value = torch.randn(2, 3, 60, 8, generator=generator)
    attention = torch.rand(2, 3, 60, generator=generator) ** 3
    attention[0, 1, :10] = 0.0
    scores = torch.rand(2, 3, 60, generator=generator)
    keep = torch.tensor([[12, 20, 7], [30, 12, 60]])
    order = scores.argsort(dim=-1, descending=True)
    columns = torch.full((2, 3, 60), -1)
    for b in range(2):
        for h in range(3):
            columns[b, h, : keep[b, h]] = order[b, h, : keep[b, h]].sort().values
    columns = columns[..., : int(keep.max())]
    evicted = ~kept_mask(columns, 60)
    kept_values = value.gather(2, columns.clamp(min=0)[..., None].expand(-1, -1, -1, 8)) * (columns >= 0)[..., None]
    draws = None if expected else torch.rand(2, 3, 60, generator=generator, dtype=torch.float64)
    ours = cam_merge(value, evicted, columns, kept_values, attention, merge_tokens, draws)
    torch.testing.assert_close(ours, cam_oracle(value, evicted, columns, kept_values, attention, merge_tokens, draws),
                               rtol=1e-5, atol=1e-5)
    assert bool((ours[columns < 0] == 0).all())


def test_cam_method_keeps_keys_and_the_window_summed_attention_selection():
    query, key, value = random_qkv(length=90, seed=6)
    budget = dict(max_capacity_prompts=30, window_size=8)
    cam = compress_kv(query, key, value, dict(method="cam", **budget))
    plain = compress_kv(query, key, value, dict(method="snapkv", pooling="none", **budget))
    assert torch.equal(cam.indices, plain.indices) and torch.equal(cam.keys, plain.keys)
    assert not torch.equal(cam.values, plain.values)
    again = compress_kv(query, key, value, dict(method="cam", **budget))
    other_seed = compress_kv(query, key, value, dict(method="cam", cam_seed=1, **budget))
    assert torch.equal(cam.values, again.values) and not torch.equal(cam.values, other_seed.values)
    expected = compress_kv(query, key, value, dict(method="cam", cam_expected=True, **budget))
    assert not torch.equal(expected.values, cam.values) and torch.equal(expected.keys, cam.keys)


# ---------------------------------------------------------------- CaM, reference cascade
def test_cam_reference_reproduces_the_sequential_cascade_by_hand():
    """L = 10: start = ceil(1.0) = 1, R = m = 2, p = 1 .. 7. Attention 1 at positions 3 and 4
    (pi = 1 there, 0 elsewhere); values one-hot. p = 3 adds v_3 / 2 to v_4 and v_5; p = 4
    then adds the already-merged v_4 / 2 to v_5 and v_6."""
    value = torch.eye(10)[None]
    attention = torch.zeros(1, 10)
    attention[0, 3] = attention[0, 4] = 1.0
    merged = cam_reference_values(value, attention, 2, None)[0]
    e = torch.eye(10)
    expected = e.clone()
    expected[4] = e[4] + e[3] / 2
    expected[5] = e[5] + e[3] / 2 + (e[4] + e[3] / 2) / 2
    expected[6] = e[6] + (e[4] + e[3] / 2) / 2
    torch.testing.assert_close(merged, expected)


def test_cam_reference_with_seeded_draws_follows_the_bernoulli_decisions():
    generator = torch.Generator().manual_seed(0)
    value = torch.randn(2, 40, 4, generator=generator)
    attention = torch.rand(2, 40, generator=generator)
    draws = torch.rand(2, 40, generator=generator, dtype=torch.float64)
    merged = cam_reference_values(value, attention, 4, draws)
    oracle = value.double().clone()
    start = math.ceil(0.1 * 40)
    for p in range(start, 40 - 4):
        mu = torch.maximum(attention[:, :start].amax(-1), attention[:, p : p + 4].amax(-1)).double()
        z = (draws[:, p] < (attention[:, p].double() / mu).clamp(0, 1)).double()
        oracle[:, p + 1 : p + 5] += (z[:, None] * oracle[:, p] / 4)[:, None, :]
    torch.testing.assert_close(merged, oracle.float())


def test_cam_reference_mode_stores_the_merged_values_of_the_kept_tokens():
    query, key, value = random_qkv(length=90, seed=8)
    config = dict(method="cam", cam_mode="reference", max_capacity_prompts=30, window_size=8)
    out = compress_kv(query, key, value, config)
    plain = compress_kv(query, key, value, dict(method="cam", max_capacity_prompts=30, window_size=8))
    assert torch.equal(out.indices, plain.indices) and torch.equal(out.keys, plain.keys)
    unmerged = value.gather(2, out.indices[..., None].expand(-1, -1, -1, 16))
    early = out.indices <= math.ceil(0.1 * 90)  # merges start at p = ceil(0.1 L) and reach p + 1 onwards
    assert bool(early.any()) and torch.equal(out.values[early], unmerged[early])
    assert not torch.equal(out.values, unmerged)


# ---------------------------------------------------------------- batches and the model
MERGE_CONFIGS = {
    "cam": dict(method="cam"),
    "cam_expected": dict(method="cam", cam_expected=True, cam_merge_tokens=4),
    "cam_reference": dict(method="cam", cam_mode="reference"),
    "snapkv_pivot": dict(method="snapkv", merge="pivot"),
    "adakv_pivot": dict(method="adakv", merge="pivot"),
}


@pytest.mark.parametrize("name", sorted(MERGE_CONFIGS))
def test_compress_kv_rows_of_a_left_padded_batch_equal_their_single_row_runs(name):
    lengths = [90, 64, 20]  # the last row fits in the budget
    query, key, value = random_qkv(batch=3, length=90, seed=12)
    mask = torch.zeros(3, 90, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 90 - length :] = 1
    config = dict(MERGE_CONFIGS[name], max_capacity_prompts=24, window_size=8)
    batched = compress_kv(query, key, value, config, layer_idx=1, num_layers=3, attention_mask=mask)
    for row, length in enumerate(lengths):
        part = slice(90 - length, 90)
        alone = compress_kv(query[row : row + 1, :, part], key[row : row + 1, :, part], value[row : row + 1, :, part],
                            config, layer_idx=1, num_layers=3)
        width = alone.indices.shape[-1]
        assert torch.equal(batched.indices[row, :, :width], alone.indices[0])
        torch.testing.assert_close(batched.keys[row, :, :width], alone.keys[0])
        torch.testing.assert_close(batched.values[row, :, :width], alone.values[0])


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("name", ["cam", "cam_reference", "snapkv_pivot"])
def test_budget_at_or_above_prompt_reproduces_unpatched_outputs(family, backend, name):
    model = tiny_model(family, backend)
    input_ids, attention_mask = left_padded([70, 52, 31])
    assert_patch_reproduces_unpatched(model, family, input_ids, attention_mask, max_capacity_prompts=70,
                                      window_size=8, **MERGE_CONFIGS[name])


@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("qwen2", "eager"), ("gemma3", "sdpa")])
@pytest.mark.parametrize("name", sorted(MERGE_CONFIGS))
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family, backend, name):
    model = tiny_model(family, backend)
    replace_for(family)(max_capacity_prompts=24, window_size=8, **MERGE_CONFIGS[name])
    assert_rows_match_single_row_runs(model, [90, 64, 41])


def test_similarity_merge_folds_each_evicted_value_into_its_most_similar_kept_key_by_cosine_and_norm_share():
    """kvpress' MergingPress: w_e = max(cos, 0) |v_e| / (|v_e| + |v_r| + 1e-6), v_r <- (v_r + sum w v_e) / (1 + sum w);
    an evicted key pointing away from every kept one (cos < 0) merges with weight 0; keys stay."""
    from restkv.merges.similarity import similarity_merge

    key = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, -0.2]])[None, None]
    value = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0], [9.0, 9.0]])[None, None]
    columns = torch.tensor([[[0, 1]]])
    evicted = torch.tensor([[[False, False, True, True]]])
    merged = similarity_merge(key, value, evicted, columns, key[:, :, :2], value[:, :, :2])
    cosine = 1 / math.sqrt(2)  # token 2 is as close to both; the first kept slot wins the tie
    weight = cosine * 5.0 / (5.0 + 1.0 + 1e-6)
    torch.testing.assert_close(merged[0, 0, 0], (torch.tensor([1.0, 0.0]) + weight * torch.tensor([3.0, 4.0])) / (1 + weight))
    torch.testing.assert_close(merged[0, 0, 1], torch.tensor([0.0, 2.0]))
    none = similarity_merge(key, value, evicted, columns, key[:, :, :2], value[:, :, :2], threshold=0.9)
    torch.testing.assert_close(none, value[:, :, :2])


def test_cams_merge_is_a_part_of_its_own_that_any_query_scorer_takes():
    """``--method cam`` is its scores and the ``cam`` merge: SnapKV without pooling (the same window-summed scores)
    with ``--merge cam`` keeps and merges exactly the same; cam's own merge takes no other, and a scorer without
    queries cannot weigh evicted values."""
    query, key, value = random_qkv(length=96)
    budget = dict(max_capacity_prompts=40, window_size=8, cam_merge_tokens=4)
    method = compress_kv(query, key, value, dict(method="cam", **budget))
    composed = compress_kv(query, key, value, dict(method="snapkv", pooling="none", merge="cam", **budget))
    plain = compress_kv(query, key, value, dict(method="snapkv", pooling="none", **budget))
    assert torch.equal(method.indices, composed.indices) and torch.equal(method.values, composed.values)
    assert not torch.equal(method.values, plain.values)
    assert CompressionConfig(method="cam", max_capacity_prompts=40).describe() == "--method cam"
    with pytest.raises(ConfigError, match="--method cam merges with its own cam merge; --merge pivot does not apply"):
        CompressionConfig(method="cam", merge="pivot", max_capacity_prompts=40)
    with pytest.raises(ConfigError, match="--merge cam weighs evicted values .* --method streamingllm scores without"):
        CompressionConfig(method="streamingllm", merge="cam", max_capacity_prompts=40)
