"""KVCompose (--method kvcompose): replay attention scores, layer budgets from composite scores."""

import warnings

import pytest
import torch
from tiny_models import greedy, random_prompt, random_qkv, replace_for, tiny_model

from restkv import CompressionConfig
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask


def test_a_tokens_score_is_its_largest_attention_group_averaged_plus_the_mean_over_heads():
    query, key, value = random_qkv(length=60, seed=71)
    config = CompressionConfig(method="kvcompose", max_capacity_prompts=20, window_size=10, observation="window")
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 60, key.device)))
    logits = query[0, :, -10:] @ key[0].repeat_interleave(2, dim=0).transpose(-1, -2) / 4.0
    causal = torch.arange(60)[None] > torch.arange(50, 60)[:, None]
    largest = logits.masked_fill(causal, float("-inf")).softmax(dim=-1).amax(dim=1)  # [H, N]
    per_kv_head = largest.view(2, 2, 60).mean(dim=1)
    torch.testing.assert_close(config.policy.score(ctx)[0], per_kv_head + per_kv_head.mean(dim=0), rtol=1e-5,
                               atol=1e-6)


def contexts_of(config, scores: list[torch.Tensor]):
    """One LayerInputs per layer of a 40-token prompt, for allocation tests on given scores."""
    query, key, value = random_qkv(length=40, seed=72)
    valid = valid_from_mask(None, 1, 40, key.device)
    return {layer: LayerInputs(query, key, value, plan_layer(config, valid, layer, len(scores)))
            for layer in range(len(scores))}


def test_structured_budgets_are_the_layers_shares_of_the_top_composite_entries():
    """Layer 1's heads score high, layer 2's low; layer 0 is raised to the layers' maximum."""
    generator = torch.Generator().manual_seed(3)
    levels = (0.1, 1.0, 0.01)
    scores = [torch.rand(1, 2, 40, generator=generator) * level for level in levels]
    config = CompressionConfig(method="kvcompose", max_capacity_prompts=10, window_size=0)
    contexts = contexts_of(config, scores)
    keeps = config.allocator.allocate_model(contexts, {layer: s for layer, s in enumerate(scores)})
    composite = [s[0].sort(dim=-1, descending=True).values.mean(dim=0) for s in scores]
    composite[0] = torch.stack(composite).amax(dim=0)
    winners = torch.cat(composite).topk(30).indices // 40
    expected = [int((winners == layer).sum()) for layer in range(3)]
    assert [keeps[layer][0].tolist() for layer in range(3)] == [[count, count] for count in expected]
    assert sum(expected) == 30 and expected[2] < expected[1] <= expected[0]


def test_unstructured_budgets_are_each_heads_share_of_the_top_sorted_scores():
    generator = torch.Generator().manual_seed(4)
    scores = [torch.rand(1, 2, 40, generator=generator) * torch.tensor([[[1.0], [0.2]]]) for _ in range(2)]
    config = CompressionConfig(method="kvcompose", max_capacity_prompts=10, window_size=0,
                               kvcompose_unstructured=True)
    keeps = config.allocator.allocate_model(contexts_of(config, scores), dict(enumerate(scores)))
    flat = torch.cat([s[0].reshape(-1) for s in scores])
    winners = flat.topk(40).indices // 40  # (layer, head) index
    assert [keeps[layer][0, head].item() for layer in range(2) for head in range(2)] == \
        [int((winners == index).sum()) for index in range(4)]


@pytest.mark.parametrize("unstructured", [False, True])
def test_the_model_replays_the_bare_context_and_keeps_the_models_budget(unstructured):
    model = tiny_model("llama")
    replace_for("llama")(method="kvcompose", max_capacity_prompts=20, kvcompose_unstructured=unstructured)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "without a reconstruction prompt" warning: the bare context is KVCompose's
        cache = output_cache(greedy(model, random_prompt(1, 60), new_tokens=1))
    counts = [[len(head) for head in layer.exact[0]] for layer in kept_positions(cache)]
    assert sum(map(sum, counts)) == 3 * 2 * 20
    assert all(len(set(layer)) == 1 for layer in counts) or unstructured


def test_the_replay_reads_the_whole_context_at_once_as_kvcompose_does(repeated_pieces):
    """KVCompose replays the context once (KVzip's 2048-token chunks were the default: a 2100-token context was
    scored in two pieces whose queries never saw each other); --reconstruction_chunk still splits it."""
    model = tiny_model("llama", max_position_embeddings=4400)
    for chunk, expected in (({}, [(0, 2100)]),
                            ({"reconstruction_chunk": 2048}, [(0, 2048), (2048, 2100)])):
        repeated_pieces.clear()
        replace_for("llama")(method="kvcompose", max_capacity_prompts=20, **chunk)
        greedy(model, random_prompt(1, 2100), new_tokens=1)
        assert repeated_pieces == expected
