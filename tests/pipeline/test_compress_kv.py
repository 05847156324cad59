"""The tensor-level entry point: shapes, order, padding, GQA, budgets, errors."""

import pytest
import torch
from tiny_models import random_qkv, registered_methods, rope_tables

from restkv import CompressionConfig, ConfigError, compress_kv

#: every registered method whose heads keep the budget and whose kept entries are the inputs
METHODS = registered_methods(uniform=True, keeps_inputs=True)


def qkv(heads=6, length=120, dim=8, **options):
    """:func:`random_qkv` with this file's default shapes."""
    return random_qkv(heads=heads, length=length, dim=dim, **options)


def config_for(method, budget=40):
    options = dict(l2norm_skip_layers=()) if method == "l2norm" else {}
    return CompressionConfig(method=method, max_capacity_prompts=budget, window_size=8, **options)


#: an output projection for the scorers that read one (``[hidden, heads * dim]`` of ``qkv()``)
O_PROJ = torch.randn(32, 6 * 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", METHODS)
def test_kept_entries_are_the_inputs_at_ascending_positions(method):
    query, key, value = qkv()
    out = compress_kv(query, key, value, config_for(method), o_proj_weight=O_PROJ, rotary=rope_tables(query))
    assert out.keys.shape == (1, 2, 40, 8) and out.indices.shape == (1, 2, 40)
    for head in range(2):
        positions = out.indices[0, head]
        assert bool((positions[1:] > positions[:-1]).all())
        assert torch.equal(out.keys[0, head], key[0, head, positions])
        assert torch.equal(out.values[0, head], value[0, head, positions])


@pytest.mark.parametrize("method", METHODS)
def test_window_is_always_kept(method):
    query, key, value = qkv()
    out = compress_kv(query, key, value, config_for(method), o_proj_weight=O_PROJ, rotary=rope_tables(query))
    protected = config_for(method).policy.protected_count(8, 40)
    for head in range(2):
        assert set(range(120 - protected, 120)) <= set(out.indices[0, head].tolist())


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_rows_equal_their_single_row_runs(method):
    lengths = [120, 90, 33]
    query, key, value = qkv(batch=3)
    mask = torch.zeros(3, 120, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 120 - length :] = 1
    batched = compress_kv(query, key, value, config_for(method), attention_mask=mask, o_proj_weight=O_PROJ,
                          rotary=rope_tables(query, mask))
    for row, length in enumerate(lengths):
        alone_query = query[row : row + 1, :, -length:]
        alone = compress_kv(alone_query, key[row : row + 1, :, -length:], value[row : row + 1, :, -length:],
                            config_for(method), o_proj_weight=O_PROJ, rotary=rope_tables(alone_query))
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


@pytest.mark.parametrize("extra, fragment", [
    (dict(rotary=(torch.ones(1, 10, 16), torch.zeros(1, 10, 16))),
     r"rotary's cos must be \[B, N, d\] = \[1, 120, 8\] \(or B = 1\); got \[1, 10, 16\]"),
    (dict(rotary=torch.ones(1, 120, 16)), r"rotary must be the \(cos, sin\) tables"),
    (dict(hidden_states=torch.randn(1, 90, 64)), r"hidden_states must be \[B, N, D\] = \[1, 120, 64\]"),
    (dict(sliding_window=0), "sliding_window must be a positive number of tokens"),
    (dict(o_proj_weight=torch.randn(64, 40)), r"o_proj_weight must be \[hidden, heads \* head_dim\]"),
    (dict(scaling=-1.0), "scaling must be a positive number"),
])
def test_bad_layer_inputs_are_rejected_naming_them(extra, fragment):
    """Given wrong, each optional input failed inside a scorer with a torch error (or, for a window of 0
    tokens, kept nothing at all)."""
    with pytest.raises(ValueError, match=fragment):
        compress_kv(*qkv(), config_for("expected_attention"), **extra)


def test_right_padding_is_rejected():
    query, key, value = qkv()
    mask = torch.ones(1, 120, dtype=torch.long)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        compress_kv(query, key, value, config_for("snapkv"), attention_mask=mask)


def test_window_attention_on_a_sliding_layer_equals_the_models_own_weights():
    """A sliding-window layer compressed below its window: the scores read the softmax the model
    computes (over every key each window query sees), only the competing tokens are limited."""
    from tiny_models import random_prompt, tiny_model

    from restkv.integrations.transformers.capture import attention_inputs
    from restkv.pipeline.inputs import LayerFacts, LayerInputs
    from restkv.pipeline.plan import plan_layer

    model = tiny_model("mistral", "eager", sliding_window=16, num_hidden_layers=1)
    captured = {}

    def capture(module, args, kwargs):
        captured["qkv"] = attention_inputs(module, kwargs["hidden_states"], kwargs["position_embeddings"])

    attention = model.model.layers[0].self_attn
    handle = attention.register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        weights = model(random_prompt(1, 40), output_attentions=True).attentions[0]
    handle.remove()
    query, key, value = captured["qkv"]
    config = CompressionConfig(method="snapkv", max_capacity_prompts=10, window_size=6)
    plan = plan_layer(config, torch.ones(1, 40, dtype=torch.bool), sliding_window=16)
    assert plan.compress and int(plan.visible_counts) == 15
    ctx = LayerInputs(query, key, value, plan, LayerFacts(attention.scaling))
    torch.testing.assert_close(ctx.window_attention(), weights[:, :, -6:, :].float(), rtol=1e-5, atol=1e-6)
    out = compress_kv(query, key, value, config, sliding_window=16)
    assert bool((out.indices[out.indices >= 0] >= 40 - 15).all())  # only visible tokens compete


def test_a_layer_index_outside_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match="layer_idx 4 must lie in 0..3"):
        compress_kv(*qkv(), dict(method="pyramidkv", max_capacity_prompts=40, window_size=8),
                    layer_idx=4, num_layers=4)
