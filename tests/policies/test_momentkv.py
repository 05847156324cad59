"""MomentKV (restkv.policies.momentkv): the evicted set's moments read as one first-order softmax
entry, moment-informed eviction, and the statistics' budget."""

import math

import pytest
import torch
from tiny_models import (assert_patch_reproduces_unpatched, assert_rows_match_single_row_runs, greedy, random_prompt,
                         random_qkv, replace_for, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import CompressedLayer, cache_report, format_report
from restkv.cache.segments.exact import joined_view
from restkv.integrations.transformers.compat import output_cache, with_cache
from restkv.integrations.transformers.generation import prefill
from restkv.pipeline.compress import compress_layer
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer

DIM = 8
SLOTS = 1 + DIM // 2  # the entry and the d x d covariance in 2d-number slots


def compressed_layer(query, key, value, **options):
    """One layer compressed with ``--method momentkv`` (window 4, no pooling), as the cache holds it."""
    options = {"method": "momentkv", "window_size": 4, "pooling": "none", **options}
    config = CompressionConfig(**options)
    valid = torch.ones(query.shape[0], key.shape[2], dtype=torch.bool)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid))
    state = compress_layer(config, ctx)
    return CompressedLayer.from_state(state, key.shape[2], None, config), state


def full_attention(query, keys, values):
    """``[B, H, d]`` softmax attention of one query per head over every key (GQA by ``h // G``)."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    weights = torch.softmax((query @ keys.transpose(-1, -2)) / math.sqrt(query.shape[-1]), dim=-1)
    return (weights @ values)[:, :, 0]


def evicted_mask(state, length):
    columns = joined_view(state.kept)[2].long()
    kept = torch.zeros(*columns.shape[:2], length + 1, dtype=torch.bool)
    kept.scatter_(2, torch.where(columns >= 0, columns, length), True)
    return ~kept[..., :length]


def read(layer, query, key, value):
    """One decode step through ``layer``: ``[B, H, d]``."""
    return layer.attend(query, key, value, None, 1.0 / math.sqrt(query.shape[-1]))[:, 0]


UNIT = torch.nn.functional.normalize(torch.arange(1.0, DIM + 1), dim=0)


def prompt_with_equal_low_keys(length=48, same=20, seed=0):
    """Random q/k/v whose window queries point along ``UNIT``, every other key leaning towards them
    and the first ``same`` keys one vector opposite (the window barely attends to them: they are the
    ones evicted), with random values."""
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=length, dim=DIM, seed=seed)
    query[0, :, -4:] = 3.0 * UNIT + 0.1 * query[0, :, -4:]
    key[0, :, same:] = 0.3 * key[0, :, same:] + 3.0 * UNIT
    key[0, :, :same] = -4.0 * UNIT
    return query, key, value


# ---------------------------------------------------------------- the readout oracles
@pytest.mark.parametrize("no_mi", [False, True])
def test_readout_is_exact_when_every_evicted_key_is_the_same(no_mi):
    query, key, value = prompt_with_equal_low_keys()
    budget = 48 - 12 + SLOTS  # 12 of the 20 equal keys are evicted
    layer, selection = compressed_layer(query, key, value, max_capacity_prompts=budget, moments_no_mi=no_mi)
    evicted = evicted_mask(selection, 48)
    assert evicted.sum(dim=-1).tolist() == [[12, 12]] and not bool(evicted[..., 20:].any())
    new_q, new_k, new_v = random_qkv(batch=1, heads=4, kv_heads=2, length=1, dim=DIM, seed=9)
    ours = read(layer, new_q, new_k, new_v)
    torch.testing.assert_close(ours, full_attention(new_q, torch.cat([key, new_k], 2), torch.cat([value, new_v], 2)),
                               rtol=1e-5, atol=1e-5)


def test_readout_is_exact_with_one_evicted_token():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=30, dim=DIM, seed=3)
    layer, selection = compressed_layer(query, key, value, max_capacity_prompts=30 - 1, moments_free_stats=True)
    assert evicted_mask(selection, 30).sum(dim=-1).tolist() == [[1, 1]]
    new_q, new_k, new_v = random_qkv(batch=1, heads=4, kv_heads=2, length=1, dim=DIM, seed=4)
    torch.testing.assert_close(read(layer, new_q, new_k, new_v),
                               full_attention(new_q, torch.cat([key, new_k], 2), torch.cat([value, new_v], 2)),
                               rtol=1e-5, atol=1e-5)


def moments_of(key, value, evicted):
    """Hand moments of one head's evicted set: n, mu_k, mu_v, C."""
    k, v = key[evicted].double(), value[evicted].double()
    mu_k, mu_v = k.mean(0), v.mean(0)
    return len(k), mu_k, mu_v, (v - mu_v).T @ (k - mu_k) / len(k)


@pytest.mark.parametrize("outside", [False, True])
def test_readout_equals_the_first_order_entry_formula(outside):
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=40, dim=DIM, seed=5)
    layer, selection = compressed_layer(query, key, value, max_capacity_prompts=20, moments_outside_softmax=outside)
    evicted = evicted_mask(selection, 40)
    new_q, new_k, new_v = random_qkv(batch=1, heads=4, kv_heads=2, length=1, dim=DIM, seed=6)
    ours = read(layer, new_q, new_k, new_v)
    scale = 1.0 / math.sqrt(DIM)
    for h in range(4):
        k_head = h // 2
        q = new_q[0, h, 0].double()
        kept = ~evicted[0, k_head]
        keys = torch.cat([key[0, k_head, kept], new_k[0, k_head]]).double()
        values = torch.cat([value[0, k_head, kept], new_v[0, k_head]]).double()
        n, mu_k, mu_v, cov = moments_of(key[0, k_head], value[0, k_head], evicted[0, k_head])
        estimate = mu_v + scale * cov @ q
        weights = torch.exp(scale * keys @ q)
        if outside:
            omega = n / (n + len(keys))
            expected = (1 - omega) * (weights @ values) / weights.sum() + omega * estimate
        else:
            mass = n * torch.exp(scale * mu_k @ q)
            expected = (weights @ values + mass * estimate) / (weights.sum() + mass)
        torch.testing.assert_close(ours[0, h].double(), expected, rtol=1e-4, atol=1e-5)


def test_the_covariance_term_makes_a_tight_evicted_set_first_order_accurate():
    query, key, value = prompt_with_equal_low_keys(seed=2)
    new_q, new_k, new_v = random_qkv(batch=1, heads=4, kv_heads=2, length=1, dim=DIM, seed=7)
    new_q = -2.0 * UNIT + 0.1 * new_q  # a later query that attends to the evicted tokens
    errors = {}
    for spread in (0.08, 0.02):
        noisy, values = key.clone(), value.clone()
        noisy[0, :, :20] += spread * torch.randn(2, 20, DIM, generator=torch.Generator().manual_seed(1))
        values[0, :, :20] = 0.5 * noisy[0, :, :20] / spread  # values correlated with keys: C matters
        exact = full_attention(new_q, torch.cat([noisy, new_k], 2), torch.cat([values, new_v], 2))
        for covariance in (True, False):
            layer, _ = compressed_layer(query, noisy, values, max_capacity_prompts=48 - 12, moments_no_mi=True,
                                        moments_covariance=covariance, moments_free_stats=True)
            errors[spread, covariance] = float((read(layer, new_q, new_k, new_v) - exact).abs().max())
    assert errors[0.08, True] < errors[0.08, False] / 4
    assert errors[0.02, True] < errors[0.08, True] / 3  # the error left is of higher order in the spread


# ---------------------------------------------------------------- moment-informed eviction
def test_without_moment_informed_eviction_the_kept_set_is_snapkv_at_the_smaller_budget():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=60, dim=DIM, seed=8)
    ours = compress_kv(query, key, value, dict(method="momentkv", max_capacity_prompts=30, window_size=4,
                                               moments_no_mi=True))
    base = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=30 - SLOTS, window_size=4))
    width = 30 - SLOTS
    assert torch.equal(ours.indices[..., :width], base.indices)
    assert ours.keys.shape[2] == width + 1 and bool((ours.indices[..., width:] == -1).all())
    assert torch.equal(ours.residual_log_counts.exp().round(), torch.full((1, 2, 1), 60.0 - width))


def test_moment_informed_eviction_multiplies_the_scores_by_the_residual_against_the_evicted_mean():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=40, dim=DIM, seed=10)
    config = CompressionConfig(method="momentkv", max_capacity_prompts=20, window_size=4, pooling="none")
    ctx = LayerInputs(query, key, value, plan_layer(config, torch.ones(1, 40, dtype=torch.bool)))
    base = config.policy.score(ctx)
    moments = config.switch("moments")
    rescored, keep, (summarised, previous) = moments.reserve(ctx, base, torch.full((1, 2), 20))
    assert keep.tolist() == [[20 - SLOTS] * 2] and bool(summarised.all()) and previous is None
    tentative = config.replace(moments_no_mi=True, max_capacity_prompts=20)
    evicted = evicted_mask(compress_layer(tentative, ctx), 40)
    for head in range(2):
        mean = key[0, head, evicted[0, head]].mean(0)
        unit = mean / mean.norm()
        residual = (key[0, head] - (key[0, head] @ unit)[:, None] * unit).norm(dim=-1)
        torch.testing.assert_close(rescored[0, head, :36], base[0, head, :36] * residual[:36])


def test_a_well_attended_token_the_summary_already_holds_is_evicted():
    query, key, value = prompt_with_equal_low_keys(length=48, same=20, seed=11)
    key[0, :, 30] = 3.0 * UNIT  # attended like its neighbours, but on the evicted keys' line (no residual)
    options = dict(method="momentkv", max_capacity_prompts=48 - 21 + SLOTS, window_size=4, pooling="none")
    ours = compress_kv(query, key, value, options)
    base = compress_kv(query, key, value, {**options, "moments_no_mi": True})
    for head in range(2):
        assert 30 in base.indices[0, head].tolist() and 30 not in ours.indices[0, head].tolist()
        assert set(range(20, 48)) - {30} <= set(ours.indices[0, head].tolist())


def test_moments_compose_with_head_and_layer_allocations():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=120, dim=DIM, seed=3)
    for allocation in ("adakv", "pyramid"):
        total = 0
        for layer in range(3):
            options = dict(method="momentkv", allocation=allocation, max_capacity_prompts=40, window_size=8)
            out = compress_kv(query, key, value, options, layer_idx=layer, num_layers=3)
            base = compress_kv(query, key, value, {**options, "method": "snapkv"}, layer_idx=layer, num_layers=3)
            exact = (out.indices >= 0).sum(dim=-1)
            summarised = torch.zeros_like(exact) if out.residual_log_counts is None else \
                torch.isfinite(out.residual_log_counts).sum(dim=-1)
            assert torch.equal(exact + summarised * SLOTS, (base.indices >= 0).sum(dim=-1))  # slots taken per head
            total += int(exact.sum()) + int(summarised.sum()) * SLOTS
        assert total == 3 * 2 * 40


# ---------------------------------------------------------------- budget and memory
def test_the_statistics_take_their_slots_from_the_budget_and_bytes_match_snapkv():
    model = tiny_model("llama")  # head dim 16: 1 + 8 slots
    prompt = random_prompt(1, 90)
    replace_for("llama")(method="snapkv", max_capacity_prompts=40, window_size=8)
    snap = prefill(model, prompt)
    replace_for("llama")(method="momentkv", max_capacity_prompts=40, window_size=8)
    ours = prefill(model, prompt)
    for layer in ours.layers:
        assert layer.kept_counts.tolist() == [[40 - 9] * 2]
        assert layer.summary_counts.tolist() == [[1, 1]]
        assert layer.summaries[0].covariance.shape == (1, 2, 16, 16)
    reports = cache_report(ours)
    # one slot for the entry, 16 x 16 / (2 x 16) = 8 for the covariance
    assert all([(s.kind, s.slots) for s in r.segments if s.tokens is None] == [("momentkv entry", 9.0)]
               for r in reports)
    assert "momentkv entry 9.0" in format_report(reports)
    used = [sum(report.used_nbytes for report in cache_report(cache)) for cache in (ours, snap)]
    assert abs(used[0] / used[1] - 1) < 0.02  # what the budget holds (the spare room follows the exact tokens)


def test_free_stats_keep_the_whole_budget_of_exact_tokens():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=60, dim=DIM, seed=8)
    out = compress_kv(query, key, value, dict(method="momentkv", max_capacity_prompts=30, window_size=4,
                                              moments_free_stats=True))
    assert (out.indices >= 0).sum(dim=-1).tolist() == [[30, 30]] and out.keys.shape[2] == 31


def test_a_head_whose_budget_cannot_hold_the_statistics_evicts_as_the_base_method():
    query, key, value = random_qkv(batch=1, heads=4, kv_heads=2, length=60, dim=DIM, seed=8)
    ours = compress_kv(query, key, value, dict(method="momentkv", max_capacity_prompts=8, window_size=4))
    base = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=8, window_size=4))
    assert ours.residual_log_counts is None and torch.equal(ours.indices, base.indices)


# ---------------------------------------------------------------- contracts
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_budget_at_or_above_the_prompt_reproduces_the_unpatched_model(backend):
    model = tiny_model("llama", backend)
    assert_patch_reproduces_unpatched(model, "llama", random_prompt(1, 60), method="momentkv",
                                      max_capacity_prompts=80, window_size=8)


@pytest.mark.parametrize("family, backend", [("llama", "eager"), ("qwen2", "sdpa"), ("gemma", "eager")])
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family, backend):
    model = tiny_model(family, backend)
    replace_for(family)(method="momentkv", max_capacity_prompts=24, window_size=8)
    assert_rows_match_single_row_runs(model, [90, 64, 41])


def test_a_question_chunk_reads_the_entry_as_its_tokens_one_by_one_would():
    model = tiny_model("llama")
    prompt = random_prompt(1, 70)
    replace_for("llama")(method="momentkv", max_capacity_prompts=30, window_size=8)
    question = torch.tensor([[7, 9, 11]])
    with torch.no_grad():
        cache = prefill(model, prompt)
        chunk = model(question, position_ids=torch.arange(70, 73)[None], **with_cache(cache)).logits
        cache = prefill(model, prompt)
        singles = [model(question[:, i : i + 1], position_ids=torch.tensor([[70 + i]]), **with_cache(cache)).logits
                   for i in range(3)]
    assert cache.layers[0].summaries[0].covariance is not None
    torch.testing.assert_close(chunk, torch.cat(singles, dim=1), rtol=1e-4, atol=1e-4)


def test_runs_repeat_bit_for_bit_and_moments_apply_to_other_scorers():
    model = tiny_model("llama")
    prompt = random_prompt(1, 80)
    for options in (dict(method="momentkv"), dict(method="h2o", moments=True),
                    dict(method="snapkv", moments=True, moments_subspace="principal", moments_vector="value")):
        replace_for("llama")(max_capacity_prompts=30, window_size=4, **options)
        first, second = greedy(model, prompt), greedy(model, prompt)
        assert torch.equal(first.sequences, second.sequences)
        for a, b in zip(output_cache(first).layers, output_cache(second).layers):
            assert torch.equal(a.kept_columns, b.kept_columns)
            assert torch.equal(a.summaries[0].covariance, b.summaries[0].covariance)


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(method="snapkv", moments=True, residual=True), "--residual"),
        (dict(method="cam", moments=True), "merges them"),
        (dict(method="snapkv", moments=True, merge="pivot"), "--merge pivot"),
        (dict(method="streamingllm", moments=True), "--moments_no_mi"),
        (dict(method="momentkv", decode_budget=64, allocation="adakv"), "--decode_budget 64 .*--allocation adakv"),
        (dict(method="momentkv", moments=False), "--no-moments"),
        (dict(method="momentkv", moments_subspace="pca"), "--moments_subspace"),
    ],
)
def test_bad_settings_name_the_flag(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(max_capacity_prompts=40, window_size=8, **options)


@pytest.mark.parametrize("covariance", [False, True])
def test_chunked_prefill_merges_the_statistics_of_every_evicted_token(covariance):
    """Issue 18: moments compose with chunked prefill and decode budgets. Layer 0's keys and values
    do not depend on what earlier layers kept, so its entry after chunks of 32 (and 12 decode steps
    under a budget) must hold the count, means and cross-covariance of every token it evicted."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 150)
    with torch.no_grad():
        full = model(prompt, use_cache=True).past_key_values.layers[0]
    replace_for("llama")(method="momentkv", max_capacity_prompts=40, window_size=4, prefill_chunk_size=32,
                         moments_covariance=covariance)
    layer = prefill(model, prompt).layers[0]
    entry = layer.summaries[0]
    kept = layer.kept_tokens()[2][0]  # [H_kv, K] positions
    for head in range(kept.shape[0]):
        evicted = torch.ones(150, dtype=torch.bool)
        evicted[kept[head][kept[head] >= 0].long()] = False
        keys, values = full.keys[0, head, evicted].float(), full.values[0, head, evicted].float()
        assert round(float(entry.log_count[0, head].exp())) == int(evicted.sum()) == 150 - int((kept[head] >= 0).sum())
        torch.testing.assert_close(entry.key_mean[0, head].float(), keys.mean(dim=0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(entry.value_mean[0, head].float(), values.mean(dim=0), rtol=1e-4, atol=1e-5)
        if covariance:
            expected = (values - values.mean(0)).T @ (keys - keys.mean(0)) / keys.shape[0]
            torch.testing.assert_close(entry.covariance[0, head].float(), expected, rtol=1e-4, atol=1e-5)
    assert int((layer.kept_counts + layer.summary_slots).max()) <= 40
    replace_for("llama")(method="momentkv", max_capacity_prompts=40, window_size=4, decode_budget=40,
                         decode_interval=4)
    out = greedy(model, prompt, new_tokens=12)
    decoded = output_cache(out).layers[0]
    assert decoded.tokens_seen == 161 and int((decoded.held_counts + decoded.summary_slots).max()) <= 40 + 4
    assert round(float(decoded.summaries[0].log_count.exp().max())) > 150 - 40  # later evictions merged in
