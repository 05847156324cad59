"""The scorers ported from kvpress 0.5.5 (KeyDiff, LagKV, CUR, NonCausalAttn, Finch, Expected Attention,
leverage scores, Compactor) and the
PyramidKV parity schedule, each against an oracle written from its formula on small tensors,
and composed with the rest of the library (or refusing what it cannot do, naming the flag)."""

import math

import pytest
import torch
from test_policies import dense_attention
from tiny_models import (assert_refused_when_configured, greedy, random_prompt, random_qkv, replace_for, rope_tables,
                         tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.allocations.pyramid_kvpress import kvpress_pyramid_totals
from restkv.cache import cache_report, kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask

PORTED = ["keydiff", "lagkv", "cur", "noncausal_attn", "finch", "qfilter", "expected_attention", "leverage", "compactor",
          "capkv"]


def scores_of(options, query, key, value, attention_mask=None, rotary=None):
    """``policy.score(ctx)`` of the config ``options`` (no protected window unless given) on one
    layer's tensors."""
    config = CompressionConfig(**{"window_size": 0, **options})
    valid = valid_from_mask(attention_mask, key.shape[0], key.shape[2], key.device)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid), rotary=rotary)
    return config.policy.score(ctx)


def kept(out, row=0, head=0):
    return [i for i in out.indices[row, head].tolist() if i >= 0]


# ---------------------------------------------------------------- KeyDiff
def test_keydiff_scores_minus_the_cosine_to_the_mean_unit_key():
    query, key, value = random_qkv(length=30, seed=2)
    scores = scores_of(dict(method="keydiff", max_capacity_prompts=10), query, key, value)
    for head in range(2):
        keys = key[0, head]
        anchor = sum(k / k.norm() for k in keys) / len(keys)
        expected = torch.stack([-(k @ anchor) / (k.norm() * anchor.norm()) for k in keys])
        torch.testing.assert_close(scores[0, head], expected)


def test_keydiff_keeps_the_key_that_points_elsewhere():
    key = torch.tensor([[[[1.0, 0.0], [2.0, 0.1], [1.0, -0.1], [0.0, 1.0], [3.0, 0.0]]]])
    out = compress_kv(key, key, key, dict(method="keydiff", max_capacity_prompts=1, window_size=0))
    assert kept(out) == [3]


# ---------------------------------------------------------------- LagKV
def lagkv_oracle(keys, values, n_sink, lag, cross):
    """Scores of the tokens that have a successor partition, one partition at a time."""
    heads, length, _ = keys.shape
    partitions = (length - n_sink) // lag - 1
    scores = torch.zeros(heads, partitions * lag)
    for head in range(heads):
        for p in range(partitions):
            start = n_sink + p * lag
            per_state = []
            for states in (keys[head], values[head]):
                target, reference = states[start : start + lag], states[start + lag : start + 2 * lag]
                low, high = reference.min(dim=0).values, reference.max(dim=0).values
                per_state.append(torch.softmax(((target - low) / (high - low)).std(dim=1), dim=0))
            score = (per_state[0] + per_state[1]) / 2
            if not cross:
                score = torch.tensor([sum(int(other < value) for other in score) for value in score]) / lag
            scores[head, p * lag : (p + 1) * lag] = score
    return scores


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_scores_each_partition_against_the_next(cross):
    _, key, value = random_qkv(length=2 + 4 * 4 + 3, seed=5)  # 2 sinks, 4 partitions of 4, 3 more
    config = CompressionConfig(method="lagkv", max_capacity_prompts=10, n_sink=2, lag_size=4,
                               lagkv_cross_scoring=cross)
    scores = config.policy.row_scores(key[0], value[0])
    torch.testing.assert_close(scores[:, 2:14], lagkv_oracle(key[0], value[0], 2, 4, cross))
    assert bool((scores[:, :2] == 3.0).all())  # sinks above everything
    tail = scores[:, 14:]  # the last full partition and the remainder: unscored, newest first
    assert bool((tail >= 2.0).all() & (tail < 3.0).all() & (tail[:, 1:] > tail[:, :-1]).all())


def test_lagkv_keeps_the_sinks_and_the_newest_tokens_when_the_budget_is_below_the_tail():
    query, key, value = random_qkv(length=4 + 2 * 16 + 5, seed=1)
    out = compress_kv(query, key, value, dict(method="lagkv", max_capacity_prompts=12, lag_size=16))
    assert kept(out) == [0, 1, 2, 3] + list(range(41 - 8, 41))



def test_lagkv_refuses_a_budget_that_does_not_exceed_its_sinks():
    """As kvzip and streamingllm: a fixed budget at once, a ratio's on the row it leaves too few (a 5-token row
    at 0.5 once kept 2 of its 4 sinks)."""
    with pytest.raises(ConfigError, match="--n_sink 4 must be smaller than --max_capacity_prompts 4"):
        CompressionConfig(method="lagkv", max_capacity_prompts=4)
    query, key, value = random_qkv(batch=2, length=60, seed=1)
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, :55] = 0
    with pytest.raises(ConfigError, match="a row of 5 tokens keeps 2 tokens .* does not exceed --n_sink 4"):
        compress_kv(query, key, value, dict(method="lagkv", compression_ratio=0.5), attention_mask=mask)

def test_lagkv_kvpress_scores_flatten_the_sinks_and_tail_and_ramp_short_prompts():
    _, key, value = random_qkv(length=40, seed=1)
    policy = CompressionConfig(method="lagkv", max_capacity_prompts=10, lag_size=16, lagkv_kvpress_scores=True).policy
    scores = policy.row_scores(key[0], value[0])
    assert bool((scores[:, :4] == 1).all() & (scores[:, 20:] == 1).all() & (scores[:, 4:20] < 1).all())
    short = policy.row_scores(key[0, :, :20], value[0, :, :20])  # under n_sink + 2 lag: nothing is scored
    torch.testing.assert_close(short[0], torch.cat([torch.ones(4), torch.arange(16) / 16]))


def test_lagkv_a_constant_channel_adds_nothing_instead_of_dividing_by_zero():
    _, key, value = random_qkv(length=4 + 3 * 8, seed=3)
    key[..., 0] = 1.0  # the same in every token: no range
    policy = CompressionConfig(method="lagkv", max_capacity_prompts=10, lag_size=8, lagkv_cross_scoring=True).policy
    scores = policy.row_scores(key[0], value[0])
    assert bool(torch.isfinite(scores).all())
    key[..., 0] = 0.0  # a constant channel's normalised value is 0 whatever the constant
    torch.testing.assert_close(scores, policy.row_scores(key[0], value[0]))


# ---------------------------------------------------------------- CUR
def test_cur_multiplies_windowed_key_and_value_leverages():
    key = torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]).sqrt()[None, None, :, None] * torch.tensor([1.0, 0.0])
    value = torch.tensor([2.0, 2.0, 1.0, 1.0, 4.0]).sqrt()[None, None, :, None] * torch.tensor([0.0, 1.0])
    scores = scores_of(dict(method="cur", max_capacity_prompts=2, n_sink=1, cur_local_window=2), key, key, value)
    k2 = torch.tensor([1 / 3, 2 / 3, 1 / 4, 3 / 4, 1.0])  # windows [0, 1], [2, 3], [4]
    v2 = torch.tensor([1 / 2, 1 / 2, 1 / 2, 1 / 2, 1.0])
    expected = k2 * v2 / (k2 * v2).sum()
    expected[0] = 1.0  # the sink
    torch.testing.assert_close(scores[0, 0], expected)
    averaged = scores_of(dict(method="cur", max_capacity_prompts=2, n_sink=0, cur_local_window=0,
                              cur_leverage="kv_avg"), key, key, value)
    # each normalised over the row before they are averaged (kvpress' use_local_approximation=False: raw)
    k2, v2 = torch.tensor([1.0, 2, 1, 3, 1]) / 8, torch.tensor([2.0, 2, 1, 1, 4]) / 10
    torch.testing.assert_close(averaged[0, 0], (k2 + v2) / 2 / ((k2 + v2) / 2).sum())


def test_cur_random_projection_is_seeded_per_layer_and_projects_before_the_norms(monkeypatch):
    query, key, value = random_qkv(length=40, seed=4)
    options = dict(method="cur", max_capacity_prompts=10, cur_random_projection=True, cur_projection_dim=3)
    first, again = scores_of(options, query, key, value), scores_of(options, query, key, value)
    assert torch.equal(first, again)
    assert not torch.equal(first, scores_of({**options, "seed": 1}, query, key, value))
    import restkv.policies.cur as cur

    monkeypatch.setattr(cur, "random_projection", lambda ctx, columns: torch.eye(16)[:, :1] * math.sqrt(columns))
    projected = scores_of({**options, "cur_projection_dim": 1}, query, key, value)
    first_channel = {**options, "cur_random_projection": False}
    torch.testing.assert_close(projected, scores_of(first_channel, query, key[..., :1], value[..., :1]))


def test_cur_an_all_zero_window_scores_zero():
    query, key, value = random_qkv(length=32, seed=2)
    key[:, :, 16:] = 0.0
    scores = scores_of(dict(method="cur", max_capacity_prompts=8, cur_local_window=16), query, key, value)
    assert bool(torch.isfinite(scores).all()) and bool((scores[..., 16:] == 0).all())


# ---------------------------------------------------------------- NonCausalAttn
def noncausal_oracle(query, key, value, chunk, kv_heads):
    """Row 0: per chunk, the full (non-causal) softmax of scaled logits, summed over queries; group
    mean, times the value norm, average pool of 3 (zeros beyond the ends), z-score over the row."""
    groups = query.shape[1] // kv_heads
    received = torch.zeros(query.shape[1], query.shape[2])
    for head in range(query.shape[1]):
        for start in range(0, query.shape[2], chunk):
            q = query[0, head, start : start + chunk]
            k = key[0, head // groups, start : start + chunk]
            received[head, start : start + chunk] = torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1).sum(0)
    scores = received.view(kv_heads, groups, -1).mean(dim=1) * value[0].norm(dim=-1)
    padded = torch.nn.functional.pad(scores, (1, 1))
    pooled = (padded[:, :-2] + padded[:, 1:-1] + padded[:, 2:]) / 3
    return (pooled - pooled.mean()) / pooled.std()


def test_noncausal_attention_scores_full_chunks_and_a_shorter_last_one():
    query, key, value = random_qkv(length=50, seed=6)
    scores = scores_of(dict(method="noncausal_attn", max_capacity_prompts=10, noncausal_chunk=16), query, key, value)
    torch.testing.assert_close(scores[0], noncausal_oracle(query, key, value, 16, 2))


def test_noncausal_kvpress_logits_pad_the_last_chunk_without_masking():
    """kvpress: no 1/sqrt(d); the 2 padded queries of the last chunk give each of its
    4 columns 1/4, and the padded key columns take logit -1e-9 from the real queries."""
    query, key, value = random_qkv(heads=1, kv_heads=1, length=6, dim=2, seed=0)
    policy = CompressionConfig(method="noncausal_attn", max_capacity_prompts=3, window_size=0, noncausal_chunk=4,
                               noncausal_kvpress_logits=True).policy
    received = policy.received_attention(query[0], key[0], 1.0, None)
    first = torch.softmax(query[0, 0, :4] @ key[0, 0, :4].T, dim=-1).sum(0)
    last_logits = torch.cat([query[0, 0, 4:] @ key[0, 0, 4:].T, torch.full((2, 2), -1e-9)], dim=-1)
    last = torch.softmax(last_logits, dim=-1).sum(0)[:2] + 2 * 0.25
    torch.testing.assert_close(received[0], torch.cat([first, last]))


def test_noncausal_default_is_kvpress_with_the_scale_and_without_its_padded_chunk():
    query, key, value = random_qkv(heads=2, kv_heads=2, length=48, seed=8)
    options = dict(method="noncausal_attn", max_capacity_prompts=10, window_size=0, noncausal_chunk=16)
    default = CompressionConfig(**options).policy
    kvpress = CompressionConfig(**options, noncausal_kvpress_logits=True).policy
    scaling = 1 / math.sqrt(16)
    ours = default.received_attention(query[0], key[0], scaling, None)
    torch.testing.assert_close(ours, kvpress.received_attention(query[0] * scaling, key[0], 1.0, None))  # 3 chunks
    partial = default.received_attention(query[0, :, :40], key[0, :, :40], scaling, None)
    padded = kvpress.received_attention(query[0, :, :40] * scaling, key[0, :, :40], 1.0, None)
    torch.testing.assert_close(partial[:, :32], padded[:, :32])
    assert not torch.allclose(partial[:, 32:], padded[:, 32:])


@pytest.mark.parametrize("method, options", [
    (method, options) for method in ("noncausal_attn", "expected_attention")
    for options in (dict(prefill_chunk_size=64), dict(allocation="model_ranked"), dict(observation="reconstruction"))
] + [("noncausal_attn", dict(decode_budget=48))])
def test_scorers_of_every_prompt_query_refuse_what_cannot_give_them_all(method, options):
    """Expected Attention reads the queries since the last compression while decoding (tests/pipeline/test_decoding.py);
    the non-causal attention needs the queries of every prompt token."""
    flag = "--" + next(iter(options))
    with pytest.raises(ConfigError, match=flag):
        CompressionConfig(method=method, max_capacity_prompts=40, window_size=8, **options)


# ---------------------------------------------------------------- Expected Attention
def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` of ``x`` ``[..., d]`` at one position."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_expected_attention_of_one_repeated_query_is_its_mean_logit_over_the_future_positions():
    """The oracle: every prompt query is the same pre-RoPE ``q`` (no covariance), so the expected
    logit of key ``k`` is the mean over the 16 next positions of ``s k . rope_t(q)``; the scores are
    their softmax over the tokens after the sinks, sinks above every other."""
    _, key, value = random_qkv(length=40, seed=4)
    q = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_tables(torch.zeros(1, 1, 40 + 16, 16))
    query = rotated(q[None, :, None], cos[0, :40][None, None], sin[0, :40][None, None])  # [1, 4, 40, 16]
    options = dict(method="expected_attention", max_capacity_prompts=10, future_positions=16, ea_vnorm=False)
    scores = scores_of(options, query, key, value, rotary=(cos[:, :40], sin[:, :40]))
    future = torch.stack([rotated(q, cos[0, t], sin[0, t]) for t in range(40, 56)])  # [16, 4, 16]
    for head in range(4):
        logits = torch.stack([key[0, head // 2, 4:] @ future[t, head] for t in range(16)]).mean(dim=0) / 4
        expected = logits.softmax(dim=-1)
        if head % 2 == 0:
            group = expected
            continue
        torch.testing.assert_close(scores[0, head // 2, 4:], (group + expected) / 2, rtol=1e-4, atol=1e-6)
        assert bool((scores[0, head // 2, :4] > scores[0, head // 2, 4:].max()).all())


def test_expected_attention_variance_raises_keys_along_the_queries_spread_and_vnorm_weights_by_values():
    """Queries spread along channel 0 only (no rotation: cos 1, sin 0): the logit of key ``k`` is
    ``s mean k_0 + s^2/2 var k_0^2``; without the covariance the mean term alone; --ea_vnorm
    multiplies by ``||v||``."""
    length, dim = 30, 16
    spread = torch.zeros(1, 4, length, dim)
    spread[..., 0] = torch.linspace(-2, 2, length)
    _, key, value = random_qkv(length=length, seed=6)
    still = (torch.ones(1, length, dim), torch.zeros(1, length, dim))
    options = dict(method="expected_attention", max_capacity_prompts=10, ea_vnorm=False)
    scores = scores_of(options, spread, key, value, rotary=still)
    observed = spread[0, 0, 4:, 0]  # the statistics skip the sinks' queries
    logits = observed.mean() * key[0, :, 4:, 0] / 4 + observed.var(unbiased=False) / dim / 2 * key[0, :, 4:, 0] ** 2
    torch.testing.assert_close(scores[0, :, 4:], logits.softmax(dim=-1), rtol=1e-4, atol=1e-7)
    flat = scores_of({**options, "ea_covariance": False}, spread, key, value, rotary=still)
    torch.testing.assert_close(flat[0, :, 4:], (observed.mean() * key[0, :, 4:, 0] / 4).softmax(dim=-1))
    weighted = scores_of({**options, "ea_vnorm": True, "ea_epsilon": 0.5}, spread, key, value, rotary=still)
    torch.testing.assert_close(weighted[0, :, 4:], (scores[0, :, 4:] + 0.5) * value[0, :, 4:].norm(dim=-1))


def test_capkv_without_temperature_scores_each_values_leverage_among_all_values():
    """--cap_tau 0: every relevance weight is 1, so a token's score is ``v_i^T (I + (1 + eps) V^T V)^-1 v_i``
    (the group's two query heads alike), whatever the queries; the sinks score above the rest."""
    query, key, value = random_qkv(length=30, seed=9)
    options = dict(method="capkv", max_capacity_prompts=10, cap_tau=0.0, cap_epsilon=0.5)
    scores = scores_of(options, query, key, value, rotary=rope_tables(query))
    for head in range(2):
        values = value[0, head, 4:]
        inverse = torch.linalg.inv(torch.eye(16) + 1.5 * values.T @ values)
        torch.testing.assert_close(scores[0, head, 4:], torch.einsum("nd,de,ne->n", values, inverse, values),
                                   rtol=1e-4, atol=1e-7)
        assert bool((scores[0, head, :4] > scores[0, head, 4:].max()).all())


def test_expected_attention_on_tensors_needs_the_rope_tables():
    query, key, value = random_qkv(length=40)
    with pytest.raises(ValueError, match="give compress_kv the layer's rotary"):
        compress_kv(query, key, value, dict(method="expected_attention", max_capacity_prompts=16, window_size=4))


@pytest.mark.parametrize("method", ["expected_attention", "capkv"])
def test_future_query_scorers_read_rope_tables_shared_by_the_rows_of_a_batch(method):
    """A model called without position_ids gives one ``[1, N, d]`` table to every row of a left-padded
    batch: each row is scored as with its own copy of the table."""
    query, key, value = random_qkv(batch=2, length=40, seed=12)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :15] = 0
    cos, sin = rope_tables(query[:1])
    options = dict(method=method, max_capacity_prompts=10, window_size=4)
    shared = scores_of(options, query, key, value, mask, rotary=(cos, sin))
    torch.testing.assert_close(shared, scores_of(options, query, key, value, mask,
                                                 rotary=(cos.expand(2, -1, -1), sin.expand(2, -1, -1))))


def test_future_positions_are_bounded_by_the_documented_maximum():
    from restkv.policies.future_queries import MAX_FUTURE_POSITIONS

    CompressionConfig(method="expected_attention", max_capacity_prompts=32, window_size=4,
                      future_positions=MAX_FUTURE_POSITIONS)
    with pytest.raises(ConfigError, match=rf"--future_positions must lie in \[1, {MAX_FUTURE_POSITIONS}\]; got 10+$"):
        CompressionConfig(method="expected_attention", max_capacity_prompts=32, window_size=4, future_positions=10**9)


# ---------------------------------------------------------------- leverage scores, Compactor
def hat_diagonal(keys: torch.Tensor) -> torch.Tensor:
    """``[H, n]`` z-scored ``diag(X (X^T X + 0.01 I)^-1 X^T)`` of the row-centred ``keys`` ``[H, n, d]``."""
    centred = keys - keys.mean(dim=1, keepdim=True)
    inverse = torch.linalg.inv(centred.transpose(1, 2) @ centred + 0.01 * torch.eye(keys.shape[-1]))
    leverage = torch.einsum("hnd,hde,hne->hn", centred, inverse, centred).clamp_min(0)
    return (leverage - leverage.mean()) / leverage.std()


def test_leverage_of_an_unsketched_key_is_its_hat_matrix_diagonal(monkeypatch):
    """With the sketch set to ``sqrt(m) I`` (m = d) the score is the exact leverage; the outlying key stays."""
    from restkv.policies import leverage

    query, key, value = random_qkv(length=40, seed=7)
    key[0, :, 13] *= 6.0
    monkeypatch.setattr(leverage, "gaussian_sketch", lambda ctx, m: math.sqrt(m) * torch.eye(16).expand(1, 2, 16, 16))
    cos, sin = rope_tables(query)
    options = dict(method="leverage", max_capacity_prompts=10, leverage_sketch_dim=16)
    scores = scores_of(options, query, key, value, rotary=(cos, sin))
    pre_rope = torch.stack([rotated(key[0, :, i], cos[0, i], -sin[0, i]) for i in range(40)], dim=1)
    torch.testing.assert_close(scores[0], hat_diagonal(pre_rope), rtol=1e-4, atol=1e-5)
    out = compress_kv(query, key, value, dict(options, window_size=2), rotary=(cos, sin))
    assert 13 in kept(out, head=0) and 13 in kept(out, head=1)


def test_leverage_sketch_is_seeded_per_layer():
    from restkv.policies.leverage import gaussian_sketch

    query, key, value = random_qkv(length=20)
    config = CompressionConfig(method="leverage", max_capacity_prompts=8, window_size=0)
    valid = valid_from_mask(None, 1, 20, key.device)
    draws = [gaussian_sketch(LayerInputs(query, key, value, plan_layer(config, valid, layer, 3)), 48)
             for layer in (0, 0, 1)]
    assert draws[0].shape == (1, 2, 16, 48) and torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_compactor_blends_the_middles_leverage_and_attention_and_keeps_its_ends():
    """The oracle is the two scorers run on the middle tokens alone (after 8 sinks, before the last 4)."""
    query, key, value = random_qkv(length=60, seed=8)
    rotary = rope_tables(query)
    options = dict(max_capacity_prompts=20, compactor_blending=0.3)
    scores = scores_of(dict(options, method="compactor"), query, key, value, rotary=rotary)
    middle = slice(8, 56)
    part = lambda method: scores_of(dict(max_capacity_prompts=20, method=method), query[:, :, middle],  # noqa: E731
                                    key[:, :, middle], value[:, :, middle],
                                    rotary=tuple(table[:, middle] for table in rotary))
    torch.testing.assert_close(scores[0, :, middle], 0.3 * part("leverage")[0] + part("noncausal_attn")[0])
    ends = torch.cat([scores[0, :, :8], scores[0, :, 56:]], dim=-1)
    assert bool((ends > scores[0, :, middle].max()).all())


@pytest.mark.parametrize("method", ["leverage", "compactor"])
@pytest.mark.parametrize("options", [dict(prefill_chunk_size=64), dict(decode_budget=48)])
def test_leverage_scorers_refuse_scoring_a_layer_again(method, options):
    with pytest.raises(ConfigError, match="--" + next(iter(options))):
        CompressionConfig(method=method, max_capacity_prompts=40, window_size=8, **options)


# ---------------------------------------------------------------- Finch
def test_finch_weights_each_window_query_by_the_tokens_before_it():
    query, key, value = random_qkv(length=40, seed=7)
    scores = scores_of(dict(method="finch", max_capacity_prompts=20, window_size=8), query, key, value)
    window = dense_attention(query, key, 2)[0, :, -8:, :]  # [H, 8, N]
    weighted = window * torch.arange(32, 40, dtype=torch.float32)[None, :, None]
    expected = weighted.mean(dim=1).view(2, 2, -1).mean(dim=1)
    torch.testing.assert_close(scores[0, :, :32], expected[:, :32])
    plain = scores_of(dict(method="finch", max_capacity_prompts=20, window_size=8, finch_normalize=False),
                      query, key, value)
    torch.testing.assert_close(plain[0, :, :32], window.mean(dim=1).view(2, 2, -1).mean(dim=1)[:, :32])


def test_finch_counts_a_padded_rows_tokens_from_its_first_real_one():
    query, key, value = random_qkv(batch=2, length=40, seed=7)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :10] = 0
    options = dict(method="finch", max_capacity_prompts=20, window_size=8)
    batched = scores_of(options, query, key, value, mask)
    alone = scores_of(options, query[1:, :, 10:], key[1:, :, 10:], value[1:, :, 10:])
    torch.testing.assert_close(batched[1, :, 10:32], alone[0, :, :22])


def test_finch_refuses_the_reconstruction_observation():
    with pytest.raises(ConfigError, match="--observation reconstruction"):
        CompressionConfig(method="finch", max_capacity_prompts=40, observation="reconstruction")



def test_finch_refuses_an_empty_question_window():
    """The window is Finch's question: without one nothing scores the context (the prefill once raised a
    RuntimeError on the empty window)."""
    with pytest.raises(ConfigError, match="--method finch scores the context by the attention of the question.*"
                                          "--window_size 0"):
        CompressionConfig(method="finch", max_capacity_prompts=32, window_size=0)

# ---------------------------------------------------------------- Q-Filters
def write_filters(path, filters):
    from safetensors.torch import save_file

    save_file({"q_filters": filters}, str(path))
    return str(path)


def test_qfilter_scores_minus_the_projection_on_the_layers_filter(tmp_path):
    query, key, value = random_qkv(length=30, seed=3)
    filters = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))
    path = write_filters(tmp_path / "filters.safetensors", filters)
    config = CompressionConfig(method="qfilter", max_capacity_prompts=10, window_size=0, qfilter_file=path)
    ctx = LayerInputs(query, key, value, plan_layer(config, torch.ones(1, 30, dtype=torch.bool), 2, 3))
    expected = torch.stack([-(key[0, head] @ filters[2, head]) for head in range(2)])
    torch.testing.assert_close(config.policy.score(ctx)[0], expected)


def test_qfilter_file_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--qfilter_file FILE"):
        CompressionConfig(method="qfilter", max_capacity_prompts=40)
    with pytest.raises(ConfigError, match="--qfilter_file .* is not a file"):
        CompressionConfig(method="qfilter", max_capacity_prompts=40, qfilter_file=str(tmp_path / "missing"))
    (tmp_path / "broken").write_text("not safetensors")
    with pytest.raises(ConfigError, match="cannot be read as safetensors"):
        CompressionConfig(method="qfilter", max_capacity_prompts=40, qfilter_file=str(tmp_path / "broken"))
    wrong = write_filters(tmp_path / "wrong.safetensors", torch.zeros(3, 4, 16))  # 4 KV heads, not 2
    query, key, value = random_qkv(length=30)
    with pytest.raises(ConfigError, match=r"--qfilter_file .* holds filters \[3, 4, 16\]"):
        compress_kv(query, key, value, dict(method="qfilter", max_capacity_prompts=10, window_size=0, qfilter_file=wrong))


def test_qfilter_file_of_another_model_is_refused_when_the_model_is_configured(tmp_path):
    for filters, needed in ((torch.randn(30, 2, 16), r"\[30, 2, 16\]"), (torch.randn(3, 2, 8), r"\[3, 2, 8\]")):
        path = write_filters(tmp_path / "other.safetensors", filters)
        assert_refused_when_configured(dict(method="qfilter", max_capacity_prompts=32, window_size=4,
                                            qfilter_file=path),
                                       rf"--qfilter_file .*other.safetensors.*: q_filters is {needed}; the model "
                                       r"needs \[3, 2, 16\]")
    nan = write_filters(tmp_path / "nan.safetensors", torch.full((3, 2, 16), float("nan")))
    with pytest.raises(ConfigError, match="--qfilter_file .*nan.safetensors.*: q_filters holds NaN"):
        CompressionConfig(method="qfilter", max_capacity_prompts=32, qfilter_file=nan)


# ---------------------------------------------------------------- PyramidKV, kvpress' schedule
def test_kvpress_pyramid_schedule_counts_the_window_inside_and_falls_back_to_the_budget():
    assert kvpress_pyramid_totals(192, 64, 384, 4, 20) == [320, 235, 149, 64]
    assert kvpress_pyramid_totals(76, 64, 384, 4, 20) == [76] * 4  # n_min = 3.8 < the window
    assert kvpress_pyramid_totals(192, 64, 384, 1, 20) == [192]


def test_pyramid_kvpress_schedule_is_the_allocation_of_its_switch():
    config = CompressionConfig(method="pyramidkv", compression_ratio=0.5, window_size=8, pyramid_kvpress_schedule=True)
    assert config.run.allocation == "pyramid_kvpress"
    query, key, value = random_qkv(length=96, seed=2)
    counts = [compress_kv(query, key, value, config, layer_idx=layer, num_layers=4).indices.shape[-1]
              for layer in range(4)]
    assert counts == kvpress_pyramid_totals(48, 8, 96, 4, 20)
    with pytest.raises(ConfigError, match="--pyramid_reference_rounding"):
        CompressionConfig(method="pyramidkv", max_capacity_prompts=40, pyramid_kvpress_schedule=True,
                          pyramid_reference_rounding=True)


# ---------------------------------------------------------------- composition
@pytest.mark.parametrize("method", PORTED)
@pytest.mark.parametrize("extra", [dict(quant_method="kivi", nbits=4), dict(allocation="adakv"),
                                   dict(residual=True, residual_no_validation=True, residual_fixed_ratio=0.25)])
def test_ported_scorers_compress_a_model_with_the_other_parts(method, extra, tmp_path):
    model = tiny_model("llama")
    if method == "qfilter":  # the tiny Llama's 3 layers, 2 KV heads of 16 channels
        extra = dict(extra, qfilter_file=write_filters(tmp_path / "filters.safetensors", torch.randn(3, 2, 16)))
    replace_for("llama")(method=method, max_capacity_prompts=24, window_size=8, **extra)
    out = greedy(model, random_prompt(1, 70), new_tokens=3)
    cache = output_cache(out)
    assert all(report.compressed for report in cache_report(cache))
    for layer, held in zip(cache.layers, kept_positions(cache)):  # 24 per head, then the decoded tokens
        assert sum(len(head) for head in held.exact[0]) + sum(held.summaries[0]) == 2 * (24 + layer.tail_length)
