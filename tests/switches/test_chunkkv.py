"""ChunkKV's --chunkkv switch: whole chunks by their mean head-summed score against an oracle,
the same positions in every head, and what it refuses."""

import pytest
import torch
from tiny_models import assert_model_compresses, random_qkv

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask


def test_chunkkv_keeps_the_window_and_the_best_whole_chunks_the_budget_holds():
    query, key, value = random_qkv(length=95, seed=21)
    options = dict(method="snapkv", max_capacity_prompts=40, window_size=5)
    config = CompressionConfig(**options)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 95, key.device)))
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



@pytest.mark.parametrize("budget", ["max_capacity_prompts", "decode_budget"])
def test_chunkkv_refuses_chunks_longer_than_a_budget_holds_beside_the_window(budget):
    """No whole 40-token chunk fits the 28 tokens a budget of 32 leaves beside a window of 4: only the window
    was kept."""
    with pytest.raises(ConfigError, match=f"--chunkkv_length 40 must not exceed the 28 tokens --{budget} 32 "
                                          "leaves beside the protected --window_size 4"):
        CompressionConfig(**{"method": "snapkv", "max_capacity_prompts": 64, "window_size": 4, "chunkkv": True,
                             "chunkkv_length": 40, budget: 32})


def test_a_row_budget_below_one_chunk_keeps_the_best_chunks_best_tokens():
    """A ratio's budget is a row's: a chunk longer than what it leaves beside the window gives its best
    tokens (kvpress keeps at least one chunk whole, past the budget), never the window alone."""
    from restkv.switches.chunkkv import ChunkSelection

    summed = torch.arange(30, dtype=torch.float32).remainder(7)
    summed[10:20] += 1  # chunk 1 has the best mean: 4 5 6 7 1 2 3 4 5 6
    protected = torch.zeros(30, dtype=torch.bool)
    protected[27:] = True
    chosen = ChunkSelection.whole_chunks(summed, protected, torch.arange(30) // 10, 8)
    assert set(chosen.nonzero().squeeze(-1).tolist()) == {13, 12, 19, 11, 18}  # its 5 best beside the 3 protected


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


def test_under_chunked_prefill_the_chunks_are_the_prompts_positions_not_the_held_tokens():
    """Each prefill chunk (13, then 3 x 40 tokens) ranks the held tokens with the new ones: the chunks stay
    the prompt's 10-position pieces, kept whole (cut over the held tokens, parts of two were kept)."""
    from tiny_models import random_prompt, replace_for, tiny_model

    from restkv.cache import kept_positions
    from restkv.integrations.transformers.generation import prefill

    model = tiny_model("llama")
    replace_for("llama")(method="l2norm", l2norm_skip_layers=(), max_capacity_prompts=47, window_size=0, chunkkv=True,
                         chunkkv_length=10, prefill_chunk_size=40)
    for layer in kept_positions(prefill(model, random_prompt(1, 133))):
        kept = set(layer.exact[0][0])
        assert all(set(range(p - p % 10, min(p - p % 10 + 10, 133))) <= kept for p in kept), sorted(kept)


def test_the_entropy_gate_keeps_a_spiky_chunks_best_tokens_and_spends_the_rest_on_more_chunks():
    """Scores 1 everywhere but chunk 2 (one token 20, the rest 0.1: a high mean from one spike) and
    chunks 5 and 0 (2 and 1.5, spread evenly); the last 2 tokens are protected. Budget 20 of 60 in
    chunks of 6: chunk 2 keeps its 2 best tokens, chunk 5 and chunk 0 whole, then the best remaining
    chunk (1: ties go to the earlier) gives the 4 tokens left: exactly 20 with the protected 2."""
    from restkv.switches.chunkkv import ChunkSelection

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
