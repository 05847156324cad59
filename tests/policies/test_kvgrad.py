"""KVgrad (--method kvgrad): KVzip's reconstruction attention weighted by gradient norms and ||v W_o||."""

import pytest
import torch
from tiny_models import greedy, random_prompt, replace_for, tiny_model

from restkv import CompressionConfig, ConfigError
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache


def test_kvgrad_keeps_the_models_budget_across_layers_and_leaves_no_parameter_gradients():
    model = tiny_model("llama")
    replace_for("llama")(method="kvgrad", max_capacity_prompts=20, reconstruction_chunk=24)
    with torch.no_grad():
        cache = output_cache(greedy(model, random_prompt(1, 60), new_tokens=1))
    counts = [len(head) for layer in kept_positions(cache) for head in layer.exact[0]]
    assert sum(counts) == 3 * 2 * 20 and len(set(counts)) > 1
    assert all(parameter.grad is None for parameter in model.parameters())


def test_kvgrad_repeats_the_context_in_its_references_chunks_of_512(repeated_pieces):
    """KVgrad's reference and kvpress' KVgradPress repeat 512 tokens at a time (KVzip's 2048 was the default);
    --reconstruction_chunk still chooses."""
    model = tiny_model("llama")
    for chunk, expected in (({}, [(0, 512), (512, 600)]),
                            ({"reconstruction_chunk": 300}, [(0, 300), (300, 600)])):
        repeated_pieces.clear()
        replace_for("llama")(method="kvgrad", max_capacity_prompts=20, **chunk)
        with torch.no_grad():
            greedy(model, random_prompt(1, 600), new_tokens=1)
        assert repeated_pieces == expected


def test_gradient_weights_change_what_kvzip_plus_keeps():
    """KVgrad is KVzip+ with each query weighted by its gradient norm instead of 1 / ||h||."""
    kept = {}
    for method, extra in (("kvgrad", {}), ("kvzip", {"kvzip_plus": True})):
        model = tiny_model("llama")
        replace_for("llama")(method=method, max_capacity_prompts=20, **extra)
        with torch.no_grad():
            kept[method] = [layer.exact for layer in kept_positions(output_cache(greedy(model, random_prompt(1, 60),
                                                                                       new_tokens=1)))]
    assert kept["kvgrad"] != kept["kvzip"]


def test_kvgrad_refuses_kvzip_plus_and_inference_mode():
    with pytest.raises(ConfigError, match="--kvzip_plus does not apply to --method kvgrad"):
        CompressionConfig(method="kvgrad", max_capacity_prompts=20, kvzip_plus=True)
    with pytest.raises(ConfigError, match="--method kvgrad differentiates .* --prefill_chunk_size 64"):
        CompressionConfig(method="kvgrad", max_capacity_prompts=20, prefill_chunk_size=64)
    model = tiny_model("llama")
    replace_for("llama")(method="kvgrad", max_capacity_prompts=20)
    with pytest.raises(RuntimeError, match="run it under torch.no_grad\\(\\), not torch.inference_mode"):
        with torch.inference_mode():
            model(random_prompt(1, 40), use_cache=True)
