"""--chunk_press (kvpress' ChunkPress): each chunk of the prompt scored alone, keeping its share."""

import pytest
import torch
from tiny_models import assert_model_compresses, random_qkv, rope_tables

from restkv import CompressionConfig, ConfigError, compress_kv


def test_each_chunk_keeps_its_share_of_its_own_best_keys():
    """With l2norm (score -||k||) each 30-token chunk keeps floor(n x 40 / 100) of its smallest keys."""
    query, key, value = random_qkv(length=100, seed=41)
    out = compress_kv(query, key, value, dict(method="l2norm", max_capacity_prompts=40, window_size=0,
                                              l2norm_skip_layers=(), chunk_press=True, chunk_press_length=30))
    norms = key[0].norm(dim=-1)
    for head in range(2):
        expected = set()
        for start, share in zip(range(0, 100, 30), (12, 12, 12, 4)):
            chunk = norms[head, start : start + 30]
            expected |= {start + int(i) for i in torch.argsort(chunk, stable=True)[:share]}
        assert set(i for i in out.indices[0, head].tolist() if i >= 0) == expected



def l2norm_chunk_choice(key, chunk, shares):
    """Per KV head, the smallest-norm ``share`` keys of each ``chunk``-token chunk (l2norm scored alone)."""
    norms = key[0].norm(dim=-1)
    return [{start + int(i) for start, share in zip(range(0, norms.shape[-1], chunk), shares)
             for i in torch.argsort(norms[head, start : start + chunk], stable=True)[:share]}
            for head in range(norms.shape[0])]


def test_under_a_ratio_each_chunk_keeps_kvpress_share_of_its_own_length():
    """kvpress keeps max(1, int(n (1 - r))) of a chunk of n: 50 of each 100-token chunk of 383 tokens at 0.5, 41
    of the last 83 (the share of the row's 191, floor(100 x 191 / 383) = 49, once kept 188)."""
    query, key, value = random_qkv(length=383, seed=44)
    out = compress_kv(query, key, value, dict(method="l2norm", compression_ratio=0.5, window_size=0,
                                              l2norm_skip_layers=(), chunk_press=True, chunk_press_length=100))
    for head, expected in enumerate(l2norm_chunk_choice(key, 100, (50, 50, 50, 41))):
        assert {i for i in out.indices[0, head].tolist() if i >= 0} == expected


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunks_too_short_for_a_token_each_share_the_budget_without_exceeding_it(chunk):
    """A chunk of n < 120 / 32 tokens has no whole token of the budget's share (kvpress keeps one of each, 120,
    60 or 40 against a budget of 32): the budget is split by the chunks' ends instead, 32 in all."""
    query, key, value = random_qkv(length=120, seed=45)
    out = compress_kv(query, key, value, dict(method="l2norm", max_capacity_prompts=32, window_size=0,
                                              l2norm_skip_layers=(), chunk_press=True, chunk_press_length=chunk))
    ends = [min(end, 120) * 32 // 120 for end in range(0, 120 + chunk, chunk)]
    shares = [b - a for a, b in zip(ends, ends[1:])]
    for head, expected in enumerate(l2norm_chunk_choice(key, chunk, shares)):
        assert len(expected) == 32 and {i for i in out.indices[0, head].tolist() if i >= 0} == expected

def test_a_window_scorer_reads_each_chunks_own_last_queries():
    """SnapKV in 50-token chunks keeps each chunk's last --window_size tokens (its own window)."""
    query, key, value = random_qkv(length=100, seed=42)
    out = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=40, window_size=6,
                                              chunk_press=True, chunk_press_length=50), rotary=rope_tables(query))
    for head in range(2):
        kept = set(i for i in out.indices[0, head].tolist() if i >= 0)
        assert len(kept) == 40 and set(range(44, 50)) <= kept and set(range(94, 100)) <= kept


@pytest.mark.parametrize("options, fragment", [
    (dict(prefill_chunk_size=64), "--prefill_chunk_size"), (dict(method="kvzip"), "--observation reconstruction"),
    (dict(allocation="adakv"), "--allocation adakv gives the heads different budgets"),
])
def test_chunk_press_refuses_what_cannot_score_a_chunk_at_its_prefill(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(**{"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8, "chunk_press": True,
                             **options})


@pytest.mark.parametrize("extra", [dict(), dict(method="cur"), dict(residual=True, residual_no_validation=True,
                                                                      residual_fixed_ratio=0.25),
                                   dict(quant_method="kivi", nbits=4), dict(method="expected_attention")])
def test_chunk_press_compresses_a_model_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 30, "window_size": 8, "chunk_press": True,
                             "chunk_press_length": 40, **extra})


def test_global_scores_give_each_chunk_its_share_of_the_whole_prompts_ranking():
    """--chunk_press_global (Finch's chunk_length): each chunk keeps, beside the window, its best tokens
    by the scores of the whole prompt (one SnapKV window), floor(n x 40 / 100) per chunk in all."""
    from restkv.pipeline.inputs import LayerInputs
    from restkv.pipeline.plan import plan_layer, valid_from_mask

    query, key, value = random_qkv(length=100, seed=43)
    options = dict(method="snapkv", max_capacity_prompts=40, window_size=6)
    config = CompressionConfig(**options)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 100, key.device)))
    scores = config.policy.score(ctx)[0]
    out = compress_kv(query, key, value, dict(options, chunk_press=True, chunk_press_length=60, chunk_press_global=True))
    for head in range(2):
        first = {int(i) for i in torch.argsort(scores[head, :60], descending=True, stable=True)[:24]}
        second = {60 + int(i) for i in torch.argsort(scores[head, 60:94], descending=True, stable=True)[: 16 - 6]}
        assert set(i for i in out.indices[0, head].tolist() if i >= 0) == first | second | set(range(94, 100))
