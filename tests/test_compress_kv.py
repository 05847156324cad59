"""The tensor-level entry point: shapes, order, padding, GQA, budgets, errors."""

import pytest
import torch

from restkv import CompressionConfig, ConfigError, compress_kv
from tiny_models import random_qkv

METHODS = ["snapkv", "h2o", "streamingllm", "l2norm", "tova", "random"]


def qkv(heads=6, length=120, dim=8, **options):
    """:func:`random_qkv` with this file's default shapes."""
    return random_qkv(heads=heads, length=length, dim=dim, **options)


def config_for(method, budget=40):
    return CompressionConfig(method=method, max_capacity_prompts=budget, window_size=8, l2norm_skip_layers=())


@pytest.mark.parametrize("method", METHODS)
def test_kept_entries_are_the_inputs_at_ascending_positions(method):
    query, key, value = qkv()
    out = compress_kv(query, key, value, config_for(method))
    assert out.keys.shape == (1, 2, 40, 8) and out.indices.shape == (1, 2, 40)
    for head in range(2):
        positions = out.indices[0, head]
        assert bool((positions[1:] > positions[:-1]).all())
        assert torch.equal(out.keys[0, head], key[0, head, positions])
        assert torch.equal(out.values[0, head], value[0, head, positions])


@pytest.mark.parametrize("method", METHODS)
def test_window_is_always_kept(method):
    query, key, value = qkv()
    out = compress_kv(query, key, value, config_for(method))
    protected = {"streamingllm": 36, "l2norm": 0, "tova": 1}.get(method, 8)
    for head in range(2):
        assert set(range(120 - protected, 120)) <= set(out.indices[0, head].tolist())


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_rows_equal_their_single_row_runs(method):
    lengths = [120, 90, 33]
    query, key, value = qkv(batch=3)
    mask = torch.zeros(3, 120, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 120 - length :] = 1
    batched = compress_kv(query, key, value, config_for(method), attention_mask=mask)
    for row, length in enumerate(lengths):
        alone = compress_kv(query[row : row + 1, :, -length:], key[row : row + 1, :, -length:], value[row : row + 1, :, -length:], config_for(method))
        width = alone.indices.shape[-1]
        assert torch.equal(batched.indices[row, :, :width], alone.indices[0])
        assert bool((batched.indices[row, :, width:] == -1).all())
        assert torch.allclose(batched.keys[row, :, :width], alone.keys[0])
        real = batched.indices[row][batched.indices[row] >= 0]
        assert bool((real < length).all())  # row-local positions of real tokens: padding never kept


def test_rows_within_budget_keep_every_real_token():
    query, key, value = qkv(batch=2)
    mask = torch.ones(2, 120, dtype=torch.long)
    mask[1, :100] = 0  # 20 real tokens, below the budget of 40
    out = compress_kv(query, key, value, config_for("snapkv"), attention_mask=mask)
    assert out.indices[1, 0].tolist() == list(range(20)) + [-1] * 20
    assert bool((out.keys[1, :, 20:] == 0).all())


def test_budget_at_or_above_the_prompt_keeps_everything():
    query, key, value = qkv(length=40)
    out = compress_kv(query, key, value, config_for("snapkv", budget=40))
    assert out.indices[0, 0].tolist() == list(range(40))
    assert torch.equal(out.keys, key)


def test_gqa_keys_are_stored_once_per_kv_head():
    query, key, value = qkv(heads=6, kv_heads=2)
    out = compress_kv(query, key, value, config_for("snapkv"))
    assert out.keys.shape[1] == 2


def test_gqa_with_identical_queries_in_a_group_equals_its_mha_collapse():
    query, key, value = qkv(heads=2, kv_heads=2)
    grouped_query = query.repeat_interleave(3, dim=1)  # 6 query heads, groups of identical heads
    for how in ("mean", "max"):
        config = config_for("snapkv").replace(gqa_score_agg=how)
        assert torch.equal(compress_kv(grouped_query, key, value, config).indices, compress_kv(query, key, value, config).indices)


def test_compression_is_deterministic():
    query, key, value = qkv()
    first = compress_kv(query, key, value, config_for("snapkv"))
    second = compress_kv(query, key, value, config_for("snapkv"))
    assert torch.equal(first.keys, second.keys) and torch.equal(first.indices, second.indices)


def test_ratio_budget_is_per_row():
    query, key, value = qkv(batch=2)
    mask = torch.ones(2, 120, dtype=torch.long)
    mask[1, :40] = 0
    out = compress_kv(query, key, value, CompressionConfig(compression_ratio=0.5, window_size=8), attention_mask=mask)
    assert (out.indices[0, 0] >= 0).sum() == 60 and (out.indices[1, 0] >= 0).sum() == 40


def test_ratio_budget_not_above_the_window_is_an_error():
    query, key, value = qkv(length=20)
    with pytest.raises(ConfigError, match="row of 20 tokens keeps 2 tokens"):
        compress_kv(query, key, value, CompressionConfig(compression_ratio=0.9, window_size=8))


def test_config_may_be_a_dict_of_release_flag_names():
    query, key, value = qkv()
    a = compress_kv(query, key, value, {"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8})
    b = compress_kv(query, key, value, config_for("snapkv"))
    assert torch.equal(a.indices, b.indices)


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        (lambda q, k, v: (q[:, :, :0], k[:, :, :0], v[:, :, :0]), "empty prompt"),
        (lambda q, k, v: (q[:, :5], k, v), "multiple of KV heads"),
        (lambda q, k, v: (q, k, v[:, :, :10]), "same shape"),
        (lambda q, k, v: (q[0], k, v), "4-D"),
    ],
)
def test_bad_tensors_are_rejected(inputs, fragment):
    with pytest.raises(ValueError, match=fragment):
        compress_kv(*inputs(*qkv()), config_for("snapkv"))


def test_right_padding_is_rejected():
    query, key, value = qkv()
    mask = torch.ones(1, 120, dtype=torch.long)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        compress_kv(query, key, value, config_for("snapkv"), attention_mask=mask)
