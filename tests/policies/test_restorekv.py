"""RestoreKV: KVzip's scores, a restore pass before eviction, the restore tokens filling n slots of each budget."""


import pytest
import torch
from tiny_models import random_prompt, tiny_model
from transformers import DynamicCache

import restkv
from restkv.cache import CompressedLayer, kept_positions
from restkv.config.options import ConfigError
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.generation import prefill
from restkv.learned.restore import SHIPPED_RESTORE, new_restore_weights, restore_weights_of, save_restore_weights

LENGTH, RESTORE = 96, 6


pytestmark = pytest.mark.filterwarnings("ignore:.*reconstruction prompt.*", "ignore:.*past_key_values.*")


def weights_file(path, model, tokens=RESTORE, seed=0):
    """Random restore weights for ``model`` with an adapter that changes the pass (``B`` drawn, not zero)."""
    generator = torch.Generator().manual_seed(seed)
    weights = new_restore_weights(model.model, tokens, 2, 1.0, generator)
    for _, up in weights.adapters.values():
        up.normal_(0, 0.2, generator=generator)
    save_restore_weights(path, weights, {"held_out": {"test": {}}})
    return str(path)


@pytest.fixture
def model_and_file(tmp_path):
    model = tiny_model("llama")
    return model, weights_file(tmp_path / "restore.safetensors", model)


def compressed(model, path, ids=None, **options):
    ids = random_prompt(1, LENGTH) if ids is None else ids
    with restkv.compression(model, method="restorekv", restore_weights=path, **{"compression_ratio": 0.5, **options}):
        with torch.no_grad():
            return prefill(model, ids)


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_restore_tokens_fill_n_slots_of_each_head_budget(model_and_file, layerwise):
    model, path = model_and_file
    cache = compressed(model, path, kvzip_layerwise=layerwise)
    budget = LENGTH - int(LENGTH * 0.5)
    kept = [[len(head) for head in layer.exact[0]] for layer in kept_positions(cache)]
    assert sum(map(sum, kept)) + RESTORE * 3 * 2 == budget * 3 * 2  # the model-wide budget, less n per head
    if layerwise:  # every layer keeps the same total: its heads' budgets, less n each
        assert all(sum(heads) + RESTORE * 2 == budget * 2 for heads in kept)
    for layer in cache.layers:
        (restore,) = layer.summaries
        assert restore.kind == "restore tokens" and restore.budget_slots().tolist() == [[RESTORE, RESTORE]]


def test_the_eviction_is_kvzips_at_the_budget_less_the_restore_tokens(model_and_file):
    model, path = model_and_file
    ids = random_prompt(1, LENGTH)
    ours = [layer.exact for layer in kept_positions(compressed(model, path, ids))]
    with restkv.compression(model, method="kvzip", max_capacity_prompts=LENGTH // 2 - RESTORE), torch.no_grad():
        kvzip = [layer.exact for layer in kept_positions(prefill(model, ids))]
    assert ours == kvzip


def test_the_restore_keys_are_the_adapted_pass_after_the_context_and_later_tokens_continue_at_n(model_and_file):
    model, path = model_and_file
    ids = random_prompt(1, LENGTH)
    cache = compressed(model, path, ids)
    weights = restore_weights_of(path)
    reference = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=True, **with_cache(reference))
        with weights.adapted(model.model):
            positions = torch.arange(LENGTH, LENGTH + RESTORE)[None]
            model.model(inputs_embeds=weights.embeddings[None], position_ids=positions, use_cache=True,
                        **with_cache(reference))
    for layer, expected in zip(cache.layers, reference.layers):
        (restore,) = layer.summaries
        torch.testing.assert_close(restore.keys, expected.keys[:, :, LENGTH:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(restore.values, expected.values[:, :, LENGTH:], rtol=1e-5, atol=1e-5)
        assert isinstance(layer, CompressedLayer) and layer.tokens_seen == LENGTH  # the question follows at N
    assert cache.get_seq_length() == LENGTH


def test_the_adapter_is_on_only_during_the_pass_and_the_model_is_unchanged_after_it(model_and_file):
    model, path = model_and_file
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ids = random_prompt(1, 40, seed=3)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    with_adapter = compressed(model, path)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any(module._forward_hooks for module in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)
    # the adapter did change the pass: without it the restore keys differ
    weights = restore_weights_of(path)
    plain_weights = weights.__class__(weights.embeddings, {}, weights.scale, {"held_out": {"test": {}}})
    save_restore_weights(path + ".plain", plain_weights, plain_weights.training)
    without = compressed(model, path + ".plain")
    assert not torch.allclose(with_adapter.layers[1].summaries[0].keys, without.layers[1].summaries[0].keys)


def test_generation_after_the_context_runs_unchanged_with_the_restore_tokens_in_the_cache(model_and_file):
    model, path = model_and_file
    ids, question = random_prompt(1, LENGTH), random_prompt(1, 4, seed=9)
    with restkv.compression(model, method="restorekv", restore_weights=path, compression_ratio=0.5):
        answer, cache = restkv.generate_after_context(model, ids, question, max_new_tokens=3, min_new_tokens=3,
                                                      do_sample=False, return_cache=True)
    assert answer.shape == (1, 3)
    for layer in cache.layers:  # the question and the answer followed the context at its own positions
        assert layer.tokens_seen == LENGTH + 4 + 2 and layer.summaries[0].kind == "restore tokens"


def test_another_models_weights_are_refused_naming_the_flag_and_file(tmp_path):
    model = tiny_model("llama")
    other = weights_file(tmp_path / "other.safetensors", tiny_model("llama", hidden_size=32, num_attention_heads=2,
                                                                     num_key_value_heads=1))
    with pytest.raises(ConfigError, match=r"^--restore_weights '.*other.safetensors': restore_embeddings is \[6, 32\]; "
                                          r"the model needs \[\*, 64\] \(a file made for another model\?\)$"):
        with restkv.compression(model, method="restorekv", restore_weights=other, compression_ratio=0.5):
            pass
    with pytest.raises(ConfigError, match="the shipped restore weights are SmolLM2-135M's: train weights for this "
                                          "model with python -m restkv.tools.train_restore"):
        with restkv.compression(model, method="restorekv", compression_ratio=0.5):
            pass


def test_a_file_without_restore_embeddings_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError, match=r"^--restore_weights '.*bad.safetensors' holds no restore_embeddings"):
        restkv.CompressionConfig(method="restorekv", compression_ratio=0.5,
                                 restore_weights=str(tmp_path / "bad.safetensors"))


@pytest.mark.parametrize("options, message", [
    ({"observation": "window"}, "--method restorekv runs its restore pass after KVzip's reconstruction; "
                                "--observation window scores without it"),
    ({"prefill_chunk_size": 32}, "--method restorekv encodes its restore tokens over the whole uncompressed context; "
                                 "--prefill_chunk_size 32 compresses it chunk by chunk"),
    ({"max_capacity_prompts": 10, "compression_ratio": None}, "--max_capacity_prompts 10 must exceed --n_sink 4 and "
                                                              "the 6 restore tokens of --restore_weights"),
])
def test_what_the_restore_pass_cannot_run_with_is_refused(model_and_file, options, message):
    _, path = model_and_file
    settings = {"method": "restorekv", "compression_ratio": 0.5, "restore_weights": path, **options}
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        restkv.CompressionConfig(**{name: value for name, value in settings.items() if value is not None})


def test_the_shipped_weights_are_read_by_default():
    assert restkv.CompressionConfig(method="restorekv", compression_ratio=0.5).policy.file_read(
        "restore_weights") == str(SHIPPED_RESTORE)
    assert restore_weights_of(str(SHIPPED_RESTORE)).tokens == 8
