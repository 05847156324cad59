"""CriticalKV's --critical switch: the two stages against an oracle on small tensors, its
limits (a first stage of the whole budget is the scorer alone), and composition."""

import pytest
import torch
from tiny_models import assert_model_compresses, random_qkv

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask

O_PROJ = torch.randn(40, 4 * 16, generator=torch.Generator().manual_seed(2))


def kept_sets(out) -> list[set[int]]:
    return [set(i for i in out.indices[0, head].tolist() if i >= 0) for head in range(out.indices.shape[1])]


def output_norms(value: torch.Tensor) -> torch.Tensor:
    """``[H_kv, N]`` the oracle's ``||v W_o^h||_1``, averaged over each KV head's 2 query heads."""
    weight = O_PROJ.view(40, 4, 16)
    return torch.stack([sum((value[0, kv] @ weight[:, head].T).abs().sum(dim=-1) for head in (2 * kv, 2 * kv + 1)) / 2
                        for kv in range(2)])


def test_critical_keeps_the_first_stage_by_the_score_and_the_rest_by_score_times_output_norm():
    query, key, value = random_qkv(length=80, seed=11)
    config = CompressionConfig(method="snapkv", max_capacity_prompts=30, window_size=6, critical=True,
                               critical_first_stage=0.5, critical_epsilon=0.01)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 80, key.device)))
    scores = config.policy.score(ctx)[0]  # [H_kv, N]
    out = compress_kv(query, key, value, config, o_proj_weight=O_PROJ)
    weighted = (scores + 0.01) * output_norms(value)
    for head, ours in enumerate(kept_sets(out)):
        window = set(range(74, 80))
        first = [int(i) for i in torch.argsort(scores[head, :74], descending=True, stable=True)[: 15 - 6]]
        rest = [int(i) for i in torch.argsort(weighted[head, :74], descending=True, stable=True) if int(i) not in first]
        assert ours == window | set(first) | set(rest[: 30 - 15])


@pytest.mark.parametrize("share, same_as", [(1.0, "base"), (0.0, "weighted")])
def test_a_first_stage_of_the_whole_budget_is_the_scorer_alone_and_none_is_the_weighted_ranking(share, same_as):
    query, key, value = random_qkv(length=80, seed=12)
    options = dict(method="snapkv", max_capacity_prompts=30, window_size=6)
    ours = kept_sets(compress_kv(query, key, value, dict(options, critical=True, critical_first_stage=share,
                                                         critical_epsilon=0.0), o_proj_weight=O_PROJ))
    if same_as == "base":
        assert ours == kept_sets(compress_kv(query, key, value, options))
        return
    config = CompressionConfig(**options)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 80, key.device)))
    weighted = config.policy.score(ctx)[0] * output_norms(value)
    for head, kept in enumerate(ours):
        top = torch.argsort(weighted[head, :74], descending=True, stable=True)[:24].tolist()
        assert kept == set(range(74, 80)) | set(top)


def test_critical_with_adakv_keeps_adakvs_head_counts():
    """CriticalAdaKV: the heads' budgets are the allocation's from the scorer's own scores."""
    query, key, value = random_qkv(length=100, seed=13)
    options = dict(method="adakv", max_capacity_prompts=30, window_size=6)
    base = compress_kv(query, key, value, options)
    critical = compress_kv(query, key, value, dict(options, critical=True), o_proj_weight=O_PROJ)
    counts = lambda out: (out.indices >= 0).sum(dim=-1).tolist()  # noqa: E731
    assert counts(critical) == counts(base) and counts(base)[0][0] != counts(base)[0][1]
    assert kept_sets(critical) != kept_sets(base)


def test_critical_needs_the_output_projection_and_a_scorer():
    query, key, value = random_qkv(length=40)
    with pytest.raises(ValueError, match="--critical"):
        compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=16, window_size=4, critical=True))
    with pytest.raises(ConfigError, match="--method streamingllm keeps tokens by position"):
        CompressionConfig(method="streamingllm", max_capacity_prompts=16, critical=True)
    with pytest.raises(ConfigError, match="--critical_first_stage"):
        CompressionConfig(method="snapkv", max_capacity_prompts=16, critical=True, critical_first_stage=1.5)


@pytest.mark.parametrize("extra", [dict(), dict(residual=True, residual_no_validation=True, residual_fixed_ratio=0.25),
                                   dict(quant_method="kivi", nbits=4), dict(method="kvzip"),
                                   dict(prefill_chunk_size=32)])
def test_critical_compresses_a_model_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 24, "window_size": 8, "critical": True,
                             **extra}, length=70)
