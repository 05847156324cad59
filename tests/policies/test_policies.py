"""Each baseline policy against its oracle: the formula written out on small tensors."""

import math

import pytest
import torch
from tiny_models import random_qkv

from restkv import compress_kv
from restkv.policies.h2o import QUERY_CHUNK


def dense_attention(query, key, kv_heads):
    """Full causal softmax attention [B, H, N, N] (tiny prompts only: the oracle)."""
    groups = query.shape[1] // kv_heads
    key = key.repeat_interleave(groups, dim=1)
    logits = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def kept(indices, head=0, row=0):
    return [i for i in indices[row, head].tolist() if i >= 0]


def test_streamingllm_keeps_sinks_and_recent_whatever_the_inputs():
    for seed in range(3):
        query, key, value = random_qkv(seed=seed)
        out = compress_kv(query, key, value, dict(method="streamingllm", max_capacity_prompts=40))
        for head in range(2):
            assert kept(out.indices, head) == [0, 1, 2, 3] + list(range(96 - 36, 96))


def test_snapkv_with_kernel_one_ranks_past_tokens_by_mean_window_attention():
    query, key, value = random_qkv(heads=2, kv_heads=2, length=64)
    config = dict(method="snapkv", max_capacity_prompts=50, window_size=40, kernel_size=1, pooling="none")
    out = compress_kv(query, key, value, config)
    mean_attention = dense_attention(query, key, 2)[:, :, -40:, :24].mean(dim=2)  # window queries, past keys
    for head in range(2):
        expected = sorted(torch.topk(mean_attention[0, head], 10).indices.tolist()) + list(range(24, 64))
        assert kept(out.indices, head) == expected


def test_snapkv_avgpool_commutes_with_the_group_mean():
    """Average pooling is linear: pooling per query head then averaging the group equals
    averaging then pooling (the library's order)."""
    query, key, value = random_qkv(heads=4, kv_heads=2, length=80)
    out = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=40, window_size=16))
    attention = dense_attention(query, key, 2)[:, :, -16:, :64].sum(dim=2)  # [1, 4, 64]
    pooled = torch.nn.functional.avg_pool1d(attention.view(4, 1, 64), 5, 1, 2, count_include_pad=True).view(1, 4, 64)
    per_group = pooled.view(1, 2, 2, 64).mean(dim=2)
    for head in range(2):
        expected = sorted(torch.topk(per_group[0, head], 24).indices.tolist()) + list(range(64, 80))
        assert kept(out.indices, head) == expected


def test_snapkv_hand_case_four_tokens():
    """One head, d = 1, four tokens, window 1 (the last token), budget 2: the past token the
    last query attends to most is kept with the window."""
    query = torch.tensor([0.0, 0.0, 0.0, 1.0]).view(1, 1, 4, 1)
    key = torch.tensor([0.5, 3.0, -1.0, 0.0]).view(1, 1, 4, 1)
    value = torch.arange(4.0).view(1, 1, 4, 1)
    out = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=2, window_size=1, pooling="none"))
    assert kept(out.indices) == [1, 3]
    assert out.values.flatten().tolist() == [1.0, 3.0]


def test_ties_go_to_the_lower_position():
    query = torch.zeros(1, 1, 10, 4)  # uniform attention: every past token ties
    key = torch.randn(1, 1, 10, 4)
    out = compress_kv(query, key, key.clone(), dict(method="snapkv", max_capacity_prompts=5, window_size=2, pooling="none"))
    assert kept(out.indices) == [0, 1, 2, 8, 9]


def test_h2o_window_variant_is_snapkv_without_pooling():
    query, key, value = random_qkv()
    h2o = compress_kv(query, key, value, dict(method="h2o", max_capacity_prompts=40, window_size=16))
    snap = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=40, window_size=16, pooling="none"))
    assert torch.equal(h2o.indices, snap.indices)


@pytest.mark.parametrize("normalize", [False, True])
def test_h2o_all_queries_matches_dense_causal_column_sums(normalize):
    query, key, value = random_qkv(length=90)
    out = compress_kv(
        query, key, value,
        dict(method="h2o", max_capacity_prompts=30, window_size=8, h2o_queries="all", h2o_normalize=normalize),
    )
    columns = dense_attention(query, key, 2).sum(dim=2)  # [1, 4, 90]
    if normalize:
        columns = columns / torch.arange(90, 0, -1).float()
    grouped = columns.view(1, 2, 2, 90).mean(dim=2)[..., :82]
    for head in range(2):
        expected = sorted(torch.topk(grouped[0, head], 22).indices.tolist()) + list(range(82, 90))
        assert kept(out.indices, head) == expected


def test_h2o_all_queries_chunked_equals_one_chunk(monkeypatch):
    query, key, value = random_qkv(length=150)
    config = dict(method="h2o", max_capacity_prompts=40, window_size=8, h2o_queries="all")
    chunked = compress_kv(query, key, value, config)
    import restkv.policies.h2o as h2o

    monkeypatch.setattr(h2o, "QUERY_CHUNK", 10 * QUERY_CHUNK)
    whole = compress_kv(query, key, value, config)
    assert torch.equal(chunked.indices, whole.indices)


def test_l2norm_keeps_the_lowest_norm_keys_and_ignores_rotations():
    query, key, value = random_qkv(kv_heads=2)
    config = dict(method="l2norm", max_capacity_prompts=20, l2norm_skip_layers=())
    out = compress_kv(query, key, value, config)
    for head in range(2):
        expected = sorted(torch.topk(-key[0, head].norm(dim=-1), 20).indices.tolist())
        assert kept(out.indices, head) == expected
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(3)))
    rotated = compress_kv(query, key @ rotation, value, config)
    assert torch.equal(rotated.indices, out.indices)


def test_l2norm_skips_its_first_layers():
    query, key, value = random_qkv()
    out = compress_kv(query, key, value, dict(method="l2norm", max_capacity_prompts=20), layer_idx=1, num_layers=4)
    assert out.indices.shape[-1] == 96
    out = compress_kv(query, key, value, dict(method="l2norm", max_capacity_prompts=20), layer_idx=2, num_layers=4)
    assert out.indices.shape[-1] == 20


def test_tova_keeps_one_set_per_layer_from_the_last_query():
    query, key, value = random_qkv(heads=4, kv_heads=2)
    out = compress_kv(query, key, value, dict(method="tova", max_capacity_prompts=20))
    assert torch.equal(out.indices[0, 0], out.indices[0, 1])
    last_row = dense_attention(query, key, 2)[0, :, -1, :95].mean(dim=0)
    expected = sorted(torch.topk(last_row, 19).indices.tolist()) + [95]
    assert kept(out.indices) == expected


def test_random_control_is_seeded_and_keeps_the_window():
    query, key, value = random_qkv()
    config = dict(method="random", max_capacity_prompts=40, window_size=8)
    first, again = compress_kv(query, key, value, config), compress_kv(query, key, value, config)
    assert torch.equal(first.indices, again.indices)
    assert set(range(88, 96)) <= set(kept(first.indices))
    other = compress_kv(query, key, value, dict(config, seed=1))
    assert not torch.equal(first.indices, other.indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["snapkv", "h2o", "tova"])
def test_one_hot_attention_is_finite_and_keeps_its_token(dtype, method):
    """A window whose attention is one-hot on token 5 (weight -> 1) keeps token 5."""
    length, dim = 64, 8
    key = torch.zeros(1, 1, length, dim)
    key[0, 0, 5, 0] = 60.0
    query = torch.zeros(1, 1, length, dim)
    query[0, 0, :, 0] = 60.0
    out = compress_kv(query.to(dtype), key.to(dtype), key.to(dtype), dict(method=method, max_capacity_prompts=12, window_size=8))
    assert 5 in kept(out.indices)
    assert torch.isfinite(out.keys.float()).all()


# ---------------------------------------------------------------- defects found in review
def test_h2o_normalize_in_window_mode_divides_by_the_window_queries_that_see_the_token():
    """Every window query sees a past token, so normalising leaves the window ranking alone
    (dividing by all later prompt queries, as before, favoured recent tokens)."""
    query, key, value = random_qkv(length=96)
    options = dict(method="h2o", max_capacity_prompts=30, window_size=8)
    plain = compress_kv(query, key, value, options)
    normalised = compress_kv(query, key, value, dict(options, h2o_normalize=True))
    assert torch.equal(normalised.indices, plain.indices)


def test_queries_seeing_each_key_counts_causal_window_and_sliding_visibility():
    from restkv.policies.h2o import queries_seeing_each_key

    valid = torch.tensor([[False, True, True, True, True, True]])  # one padding column
    assert queries_seeing_each_key(valid, 2).tolist() == [[2, 2, 2, 2, 2, 1]]
    assert queries_seeing_each_key(valid, 6).tolist() == [[5, 5, 4, 3, 2, 1]]
    # A sliding window of 2: each key is seen by itself and the next query only.
    assert queries_seeing_each_key(valid, 6, sliding_window=2).tolist() == [[1, 2, 2, 2, 2, 1]]


def test_h2o_normalize_on_a_sliding_layer_caps_the_count_at_the_window():
    query, key, value = random_qkv(length=60)
    options = dict(method="h2o", max_capacity_prompts=12, window_size=4, h2o_queries="all", h2o_normalize=True)
    out = compress_kv(query, key, value, options, sliding_window=30)
    groups = 2
    keys = key.repeat_interleave(groups, dim=1)
    logits = query @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    positions = torch.arange(60)
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 30)
    attention = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    seen_by = visible.sum(dim=0).float()  # queries inside the window of each key: at most 30
    assert int(seen_by.max()) == 30
    columns = (attention.sum(dim=2) / seen_by).view(1, 2, groups, 60).mean(dim=2)
    candidates = torch.arange(31, 56)  # visible to the next query (last 29) minus the 4 protected
    for head in range(2):
        top = candidates[torch.topk(columns[0, head, 31:56], 8).indices]
        assert kept(out.indices, head) == sorted(top.tolist()) + list(range(56, 60))


def test_streamingllm_without_sinks_keeps_the_last_tokens():
    query, key, value = random_qkv()
    out = compress_kv(query, key, value, dict(method="streamingllm", max_capacity_prompts=40, n_sink=0))
    for head in range(2):
        assert kept(out.indices, head) == list(range(96 - 40, 96))
    ratio = compress_kv(query, key, value, dict(method="streamingllm", compression_ratio=0.5, n_sink=0))
    assert kept(ratio.indices) == list(range(48, 96))


def test_non_finite_scores_never_displace_the_protected_window():
    query, key, value = random_qkv(length=64)
    key[0, 0, 10] = float("nan")  # NaN logits in every window row of KV head 0
    with pytest.warns(RuntimeWarning, match="layer 0 produced .* non-finite scores"):
        out = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=20, window_size=8))
    for head in range(2):
        assert set(range(56, 64)) <= set(kept(out.indices, head))
        assert len(kept(out.indices, head)) == 20


def test_infinite_and_nan_scores_rank_below_every_finite_one():
    from restkv.scoring.selection import rank_keys, select_columns

    scores = torch.tensor([[[float("inf"), float("nan"), 0.5, 0.1, 7.0, 8.0]]])
    visible = torch.ones(1, 6, dtype=torch.bool)
    protected = torch.tensor([[False, False, False, False, True, True]])
    with pytest.warns(RuntimeWarning):
        ranked = rank_keys(scores, visible, protected, layer_idx=3)
    assert select_columns(ranked, torch.tensor([[3]])).tolist() == [[[2, 4, 5]]]
    assert select_columns(ranked, torch.tensor([[5]])).tolist() == [[[0, 2, 3, 4, 5]]]
