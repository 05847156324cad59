"""ChunkKV's --chunkkv switch: whole chunks by their mean head-summed score against an oracle,
the same positions in every head, and what it refuses."""

import pytest
import torch

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.context import ScoringContext, plan_layer, valid_from_mask
from tiny_models import assert_model_compresses, random_qkv


def test_chunkkv_keeps_the_window_and_the_best_whole_chunks_the_budget_holds():
    query, key, value = random_qkv(length=95, seed=21)
    options = dict(method="snapkv", max_capacity_prompts=40, window_size=5)
    config = CompressionConfig(**options)
    ctx = ScoringContext.of(query, key, value, plan_layer(config, valid_from_mask(None, 1, 95, key.device)))
    summed = config.policy.score(ctx)[0].sum(dim=0)
    chunk_scores = torch.stack([summed[start : start + 10].mean() for start in range(0, 95, 10)])
    expected, held = set(range(90, 95)), 5  # the window: the last chunk's 5 tokens
    for chunk in torch.argsort(chunk_scores, descending=True, stable=True).tolist():
        members = set(range(10 * chunk, min(10 * chunk + 10, 95))) - expected
        if not members:
            continue
        if held + len(members) > 40:
            break
        expected, held = expected | members, held + len(members)
    out = compress_kv(query, key, value, dict(options, chunkkv=True, chunkkv_length=10))
    for head in range(2):
        assert set(i for i in out.indices[0, head].tolist() if i >= 0) == expected


def test_chunkkv_refuses_budgets_that_differ_by_head_and_positional_methods():
    with pytest.raises(ConfigError, match="--chunkkv keeps the same chunks in every head; --allocation adakv"):
        CompressionConfig(method="snapkv", allocation="adakv", max_capacity_prompts=40, chunkkv=True)
    with pytest.raises(ConfigError, match="--method streamingllm keeps tokens by position"):
        CompressionConfig(method="streamingllm", max_capacity_prompts=40, chunkkv=True)


@pytest.mark.parametrize("extra", [dict(), dict(allocation="pyramid"), dict(quant_method="kivi", nbits=4),
                                   dict(residual=True, residual_no_validation=True, residual_fixed_ratio=0.25),
                                   dict(prefill_chunk_size=32), dict(method="expected_attention")])
def test_chunkkv_compresses_a_model_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 30, "window_size": 8, "chunkkv": True,
                             "chunkkv_length": 8, **extra})
