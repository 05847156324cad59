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


def test_the_entropy_gate_keeps_a_spiky_chunks_best_tokens_and_spends_the_rest_on_more_chunks():
    """Scores 1 everywhere but chunk 2 (one token 20, the rest 0.1: a high mean from one spike) and
    chunks 5 and 0 (2 and 1.5, spread evenly); the last 2 tokens are protected. Budget 20 of 60 in
    chunks of 6: chunk 2 keeps its 2 best tokens, chunk 5 and chunk 0 whole, then the best remaining
    chunk (1: ties go to the earlier) gives the 4 tokens left: exactly 20 with the protected 2."""
    from restkv.chunkkv import ChunkSelection

    summed = torch.ones(60)
    summed[12:18] = torch.tensor([20.0, 0.1, 0.3, 0.1, 0.1, 0.1])
    summed[30:36], summed[0:6] = 2.0, 1.5
    protected = torch.zeros(60, dtype=torch.bool)
    protected[58:] = True
    gate = ChunkSelection(chunkkv_length=6, chunkkv_entropy_gate=True, chunkkv_spiky_tokens=2)
    chosen = gate.gated_tokens(summed, protected, torch.arange(60) // 6, 20)
    assert set(chosen.nonzero().squeeze(-1).tolist()) == {12, 14} | set(range(30, 36)) | set(range(6)) | \
        {6, 7, 8, 9}
    assert not bool((chosen & protected).any())


def test_the_entropy_gate_needs_fewer_spiky_tokens_than_a_chunk():
    with pytest.raises(ConfigError, match="--chunkkv_spiky_tokens 10 must be below --chunkkv_length 10"):
        CompressionConfig(method="snapkv", max_capacity_prompts=40, chunkkv=True, chunkkv_length=10,
                          chunkkv_entropy_gate=True, chunkkv_spiky_tokens=10)
