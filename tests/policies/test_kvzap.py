"""KVzap (--method kvzap): per-layer surrogates of the hidden states score each KV head's tokens."""

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import (assert_model_compresses, assert_refused_when_configured, greedy, random_prompt, random_qkv,
                         replace_for, surrogate_file, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.generation import prefill
from restkv.learned.kvzap import SHIPPED_SURROGATES, surrogates_of, training_record


@pytest.mark.parametrize("mlp", [True, False])
def test_each_heads_score_is_its_surrogates_output_at_the_token(tmp_path, mlp):
    path, tensors = surrogate_file(tmp_path / "kvzap.safetensors", hidden=24, mlp=mlp)
    query, key, value = random_qkv(length=50, seed=81)
    hidden = torch.randn(1, 50, 24, generator=torch.Generator().manual_seed(2))
    out = compress_kv(query, key, value, dict(method="kvzap", max_capacity_prompts=20, window_size=0,
                                              kvzap_weights=path), layer_idx=1, num_layers=3, hidden_states=hidden)
    if mlp:
        inner = torch.nn.functional.gelu(hidden[0] @ tensors["layers.1.0.weight"].T + tensors["layers.1.0.bias"])
        scores = inner @ tensors["layers.1.2.weight"].T + tensors["layers.1.2.bias"]
    else:
        scores = hidden[0] @ tensors["layers.1.weight"].T + tensors["layers.1.bias"]
    for head in range(2):
        assert set(out.indices[0, head].tolist()) == set(scores[:, head].topk(20).indices.tolist())


def test_kvzap_reads_its_weights_and_needs_the_hidden_states(tmp_path):
    with pytest.raises(ConfigError, match="--kvzap_weights .* is not a file"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=str(tmp_path / "none"))
    save_file({"q_filters": torch.zeros(2, 2, 4)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ConfigError, match="holds no KVzapModel layers"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=str(tmp_path / "other.safetensors"))
    path, _ = surrogate_file(tmp_path / "kvzap.safetensors")
    with pytest.raises(ConfigError, match="--method kvzap scores the hidden states .* --prefill_chunk_size"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path,
                          prefill_chunk_size=32)
    with pytest.raises(ConfigError, match="--block_press .* hidden states"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path, block_press=True)
    query, key, value = random_qkv(length=50)
    with pytest.raises(ValueError, match="give compress_kv the layer's hidden_states"):
        compress_kv(query, key, value, dict(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path))


def test_the_model_scores_the_attentions_input(tmp_path):
    """The kept set of each layer is the top of the surrogate over the normed input of its attention."""
    path, _ = surrogate_file(tmp_path / "kvzap.safetensors")
    model = tiny_model("llama")
    inputs = {}

    def record(module, args, kwargs):
        inputs.setdefault(module.layer_idx, kwargs["hidden_states"])

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    replace_for("llama")(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)
    cache = output_cache(greedy(model, random_prompt(1, 50), new_tokens=1))
    for hook in hooks:
        hook.remove()
    config = CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)
    for layer, kept in enumerate(kept_positions(cache)):
        query, key, value = (torch.zeros(1, 4, 50, 16), torch.zeros(1, 2, 50, 16), torch.zeros(1, 2, 50, 16))
        alone = compress_kv(query, key, value, config, layer_idx=layer, num_layers=3, hidden_states=inputs[layer])
        assert kept.exact[0] == [sorted(head.tolist()) for head in alone.indices[0]]


@pytest.mark.parametrize("extra", [dict(), dict(allocation="adakv"), dict(dms=True, dms_threshold=0.0),
                                   dict(chunk_press=True, chunk_press_length=30), dict(allocation="model_ranked")])
def test_kvzap_compresses_a_model_with_the_other_parts(tmp_path, extra):
    path, _ = surrogate_file(tmp_path / "kvzap.safetensors")
    assert_model_compresses({"method": "kvzap", "max_capacity_prompts": 30, "window_size": 8, "kvzap_weights": path,
                             **extra})


@pytest.mark.parametrize("shape, message", [
    (dict(hidden=32), r"layers.0.0.weight is \[16, 32\]; the model needs \[\*, 64\]"),
    (dict(hidden=32, mlp=False), r"layers.0.weight is \[2, 32\]; the model needs \[\*, 64\]"),
    (dict(kv_heads=4), "holds 3 surrogates of 4 KV heads; the model has 3 layers of 2"),
    (dict(layers=4), "holds 4 surrogates of 2 KV heads; the model has 3 layers of 2"),
])
def test_surrogates_of_another_model_are_refused_when_the_model_is_configured(tmp_path, shape, message):
    path, _ = surrogate_file(tmp_path / "other.safetensors", **shape)
    assert_refused_when_configured(dict(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path),
                                   f"--kvzap_weights .*other.safetensors.*{message}")


def test_surrogates_that_are_no_surrogates_are_refused_when_the_config_is_built(tmp_path):
    path, tensors = surrogate_file(tmp_path / "nan.safetensors")
    save_file({**tensors, "layers.1.2.weight": torch.full((2, 16), float("nan"))}, path)
    with pytest.raises(ConfigError, match=r"--kvzap_weights .*nan.safetensors.*: layers.1.2.weight holds NaN"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)
    save_file({**tensors, "layers.1.0.bias": torch.zeros(3)}, path)
    with pytest.raises(ConfigError, match=r"layers.1.0.bias is \[3\]; layers.1.0.weight needs \[16\]"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)
    save_file({**tensors, "layers.2.2.weight": torch.zeros(2, 8)}, path)
    with pytest.raises(ConfigError, match=r"layers.2.2.weight is \[2, 8\]; it must read 16 numbers"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)
    save_file({**tensors, "layers.1.0.weight": torch.zeros(16, 64, dtype=torch.int32)}, path)
    with pytest.raises(ConfigError, match="layers.1.0.weight must be a tensor of floating-point numbers"):
        CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=4, kvzap_weights=path)


def test_the_template_around_the_context_span_is_kept_as_kvzip_keeps_it(tmp_path):
    """KVzap ranks the context as KVzip does: the chat template around a given span is kept whatever its score."""
    path, _ = surrogate_file(tmp_path / "kvzap.safetensors")
    model = tiny_model("llama")
    replace_for("llama")(method="kvzap", max_capacity_prompts=30, window_size=0, kvzap_weights=path)
    kept = kept_positions(prefill(model, random_prompt(1, 80, seed=9), context_span=(10, 70)))
    template = set(range(10)) | set(range(70, 80))
    assert all(template <= set(head) for layer in kept for head in layer.exact[0])
    assert sum(len(head) for layer in kept for head in layer.exact[0]) == 3 * 2 * 30


def test_the_shipped_surrogates_are_the_default_and_fit_the_embedded_model_only():
    config = CompressionConfig(method="kvzap", max_capacity_prompts=20, window_size=0)
    assert config.policy.file_read("kvzap_weights") == str(SHIPPED_SURROGATES)
    surrogates = surrogates_of(str(SHIPPED_SURROGATES))
    assert len(surrogates) == 30 and surrogates[0][0][0].shape[1] == 576 and surrogates[0][-1][0].shape[0] == 3
    record = training_record(SHIPPED_SURROGATES)
    assert record["model_path"] == "smollm2-135m" and record["text"] == "restkv.tools.training_text"
    assert all(report["token_overlap"] < 0.01 and report["kvzap_recall"]["0.1"] > 0.3
               for report in record["held_out"].values())
    assert_refused_when_configured(dict(method="kvzap", max_capacity_prompts=20, window_size=4),
                                   "shipped surrogates are SmolLM2-135M's: train surrogates for this model with "
                                   "python -m restkv.tools.train_kvzap")
