"""--block_press (kvpress' BlockPress): the prompt walked in blocks, each scored with what is held so far."""

import pytest
import torch
from tiny_models import assert_model_compresses, assert_rows_match_single_row_runs, random_qkv, replace_for, tiny_model

from restkv import CompressionConfig, ConfigError, compress_kv


def kept(out, head: int) -> set[int]:
    return set(i for i in out.indices[0, head].tolist() if i >= 0)


def keydiff_walk(key: torch.Tensor, budget: int, block: int) -> set[int]:
    """The oracle: KeyDiff (score -cos(k, mean unit key of the scored tokens)) over held + block."""
    held = list(range(budget))
    for start in range(budget, key.shape[0], block):
        columns = held + list(range(start, min(start + block, key.shape[0])))
        unit = torch.nn.functional.normalize(key[columns], dim=-1)
        scores = -(unit @ torch.nn.functional.normalize(unit.mean(dim=0), dim=-1))
        held = sorted(columns[int(i)] for i in torch.argsort(scores, descending=True, stable=True)[:budget])
    return set(held)


@pytest.mark.parametrize("block", [16, 25, 70])
def test_each_block_keeps_the_budget_of_held_and_new_tokens_by_their_own_scores(block):
    query, key, value = random_qkv(length=100, seed=51)
    out = compress_kv(query, key, value, dict(method="keydiff", max_capacity_prompts=30, window_size=0,
                                              block_press=True, block_press_size=block))
    for head in range(2):
        assert kept(out, head) == keydiff_walk(key[0, head], 30, block)


def test_a_per_token_score_keeps_what_scoring_the_whole_prompt_keeps():
    """-||k|| does not depend on the other tokens: walking in blocks changes nothing."""
    query, key, value = random_qkv(length=100, seed=52)
    options = dict(method="l2norm", max_capacity_prompts=30, window_size=0, l2norm_skip_layers=())
    whole = compress_kv(query, key, value, options)
    walked = compress_kv(query, key, value, dict(options, block_press=True, block_press_size=20))
    assert torch.equal(whole.indices, walked.indices)


def test_one_block_is_the_whole_prompt_scored_at_once():
    query, key, value = random_qkv(length=100, seed=53)
    options = dict(method="snapkv", max_capacity_prompts=30, window_size=8)
    whole = compress_kv(query, key, value, options)
    walked = compress_kv(query, key, value, dict(options, block_press=True, block_press_size=70))
    assert torch.equal(whole.indices, walked.indices)


def test_a_window_scorer_keeps_the_prompts_window_and_reads_each_blocks_own_queries():
    query, key, value = random_qkv(length=100, seed=54)
    options = dict(method="snapkv", max_capacity_prompts=30, window_size=8)
    walked = compress_kv(query, key, value, dict(options, block_press=True, block_press_size=35))
    whole = compress_kv(query, key, value, options)
    for head in range(2):
        assert len(kept(walked, head)) == 30 and set(range(92, 100)) <= kept(walked, head)
    assert not torch.equal(whole.indices, walked.indices)


@pytest.mark.parametrize("options, fragment", [
    (dict(decode_budget=64), "--decode_budget"), (dict(method="kvzip"), "--observation reconstruction"),
    (dict(allocation="adakv"), "--allocation adakv gives the heads different budgets"),
    (dict(method="expected_attention"), "--method expected_attention reads the RoPE tables"),
    (dict(method="streamingllm"), "keeps tokens by position"),
])
def test_block_press_refuses_what_cannot_score_a_block_at_its_prefill(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(**{"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8, "block_press": True,
                             **options})


@pytest.mark.parametrize("extra", [dict(), dict(method="keydiff"), dict(quant_method="kivi", nbits=4),
                                   dict(think=True), dict(rerotate_keys=True)])
def test_block_press_compresses_a_model_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 30, "window_size": 8, "block_press": True,
                             "block_press_size": 24, **extra})


def test_a_padded_row_is_walked_as_it_is_alone():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8, block_press=True,
                         block_press_size=20)
    assert_rows_match_single_row_runs(model, [70, 52])
