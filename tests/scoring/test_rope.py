"""RoPE undone (restkv.scoring.rope): the exact inverse of each family's apply_rotary_pos_emb, from the
forward's own cos/sin or from positions through the model's rotary embedding (Gemma 3: per
layer type)."""

import sys

import pytest
import torch
from tiny_models import greedy, left_padded, random_prompt, replace_for, tiny_model

from restkv.integrations.transformers.capture import attention_inputs
from restkv.integrations.transformers.generation import position_ids_from_mask
from restkv.scoring.rope import rotary_inverse, unrotate


def family_rotation(model):
    """The family's own apply_rotary_pos_emb."""
    return sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb


def rotary(model, layer_idx, x, positions):
    """cos, sin of ``layer_idx`` as the decoder computes them."""
    layer_types = getattr(model.config, "layer_types", None)
    if model.config.model_type == "gemma3_text":
        return model.model.rotary_emb(x, positions, layer_types[layer_idx])
    return model.model.rotary_emb(x, positions)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_unrotate_inverts_the_familys_rotation(family):
    model = tiny_model(family)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 4, 7, 16, generator=generator), torch.randn(2, 2, 7, 16, generator=generator)
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [90, 91, 92, 93, 94, 95, 96]])  # padding, a decode offset
    for layer_idx in range(model.config.num_hidden_layers):
        cos, sin = rotary(model, layer_idx, key, positions)
        rotated_query, rotated_key = family_rotation(model)(query, key, cos, sin)
        assert not torch.allclose(rotated_key, key, atol=1e-3)
        torch.testing.assert_close(unrotate(rotated_key, cos, sin), key, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unrotate(rotated_query, cos, sin), query, rtol=1e-5, atol=1e-5)
        undo = rotary_inverse(model, layer_idx)
        torch.testing.assert_close(undo(rotated_key, positions), key, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(undo(rotated_key.bfloat16(), positions).float(), key, rtol=2e-2, atol=2e-2)


def test_gemma3_layers_are_undone_with_their_own_rope():
    """Sliding and full-attention layers rotate with different bases: each needs its own."""
    model = tiny_model("gemma3", rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    key = torch.randn(1, 2, 5, 16)
    positions = torch.arange(40, 45)[None]
    rotated = family_rotation(model)(key, key, *rotary(model, 1, key, positions))[1]  # a full-attention layer
    torch.testing.assert_close(rotary_inverse(model, 1)(rotated, positions), key, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rotary_inverse(model, 0)(rotated, positions), key, atol=1e-2)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_forwards_keys_are_undone_to_its_projections(family):
    """In a real forward (left-padded batch): the post-RoPE query/key the attention sees, undone
    with its position embeddings or its position ids, are the projections before RoPE (after
    Gemma 3's q/k norms: the same projection with cos 1 and sin 0)."""
    model = tiny_model(family)
    input_ids, attention_mask = left_padded([12, 8])
    positions = position_ids_from_mask(attention_mask)
    seen = {}

    def capture(module, args, kwargs):
        hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
        query, key, _ = attention_inputs(module, hidden, (torch.ones_like(cos), torch.zeros_like(sin)))  # no rotation
        rotated_query, rotated_key, _ = attention_inputs(module, hidden, (cos, sin))
        seen[module.layer_idx] = (query, key, rotated_query, rotated_key, cos, sin)

    hooks = [block.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for block in model.model.layers]
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions)
    for hook in hooks:
        hook.remove()
    for layer_idx, (query, key, rotated_query, rotated_key, cos, sin) in seen.items():
        torch.testing.assert_close(unrotate(rotated_key, cos, sin), key, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unrotate(rotated_query, cos, sin), query, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rotary_inverse(model, layer_idx)(rotated_key, positions), key, rtol=1e-5,
                                   atol=1e-5)


# ---------------------------------------------------------------- the layer's own rotation, probed
def rotations_after_a_prefill(family: str, **overrides) -> list:
    """What ``layer_rotary`` found for each layer of a tiny ``family`` model after one compressing prefill."""
    from restkv.integrations.transformers.rotation import _ROTATIONS

    model = tiny_model(family, **overrides)
    replace_for(family)(method="snapkv", max_capacity_prompts=40, window_size=8)
    greedy(model, random_prompt(1, 80), new_tokens=2)
    return [_ROTATIONS.get(layer.self_attn) for layer in model.model.layers]


@pytest.mark.parametrize("family, overrides, expected", [
    ("llama", {}, ["rotate_half"] * 3),
    ("smollm3", {}, ["rotate_half", "none", "rotate_half"]),  # the middle layer is NoPE
    ("cohere2", {}, ["other", "none", "other"]),  # interleaved pairs on sliding layers, no RoPE on full ones
    ("phi3", {"partial_rotary_factor": 0.5}, ["other"] * 3),  # half the channels turn
])
def test_each_layers_rotation_is_read_from_its_own_forward(family, overrides, expected):
    assert rotations_after_a_prefill(family, **overrides) == expected


def test_a_layer_without_rope_hands_scorers_the_identity_rotation():
    from restkv.integrations.transformers.capture import attention_inputs
    from restkv.integrations.transformers.rotation import layer_rotary

    model = tiny_model("smollm3")
    attention = model.model.layers[1].self_attn
    hidden = torch.randn(1, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6)[None] + 30
    tables = model.model.rotary_emb(hidden, positions)
    _, key, _ = attention_inputs(attention, hidden, tables)
    cos, sin = layer_rotary(attention, tables, hidden, key.shape[-1])
    torch.testing.assert_close(unrotate(key, cos, sin), key)
    rotating = model.model.layers[0].self_attn
    assert layer_rotary(rotating, tables, hidden, key.shape[-1]) is tables


@pytest.mark.parametrize("options, flag", [
    ({"method": "compactor"}, "--method compactor"),
    ({"method": "snapkv", "rerotate_keys": True}, "--rerotate_keys"),
])
def test_a_pre_rope_reader_is_refused_on_a_rotation_restkv_cannot_undo(options, flag):
    model = tiny_model("cohere2")
    replace_for("cohere2")(max_capacity_prompts=40, window_size=8, **options)
    with pytest.raises(ValueError, match=f"^{flag} reads keys before RoPE; cohere2 layer 0 rotates them"):
        greedy(model, random_prompt(1, 80), new_tokens=2)


def test_a_pre_rope_reader_runs_on_nope_layers():
    from restkv.cache import cache_report
    from restkv.integrations.transformers.compat import output_cache

    model = tiny_model("smollm3")
    replace_for("smollm3")(method="compactor", max_capacity_prompts=40, window_size=8)
    cache = output_cache(greedy(model, random_prompt(1, 80), new_tokens=2))
    assert all(report.compressed for report in cache_report(cache))


@pytest.mark.parametrize("family", ["llama", "gemma3", "smollm3"])
def test_pre_rope_projections_turned_with_their_tables_are_what_the_kernel_sees(family):
    from restkv.integrations.transformers.projections import pre_rope_projections
    from restkv.scoring.rope import rotate

    model = tiny_model(family)
    input_ids = random_prompt(1, 9)
    seen = {}

    def capture(module, args, kwargs):
        seen[module.layer_idx] = attention_inputs(module, kwargs["hidden_states"], kwargs["position_embeddings"])

    hooks = [block.self_attn.register_forward_pre_hook(capture, with_kwargs=True) for block in model.model.layers]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    for layer_idx, projections in enumerate(pre_rope_projections(model, input_ids)):
        rotated_query, rotated_key, _ = seen[layer_idx]
        torch.testing.assert_close(rotate(projections.key[None], *projections.rotary), rotated_key, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(rotate(projections.query[None], *projections.rotary), rotated_query, rtol=1e-5,
                                   atol=1e-5)
