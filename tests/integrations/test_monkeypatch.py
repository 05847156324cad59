"""Patching, per-model configuration, unpatching, unsupported models and versions."""

import warnings

import pytest
import torch
from tiny_models import random_prompt, tiny_model
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from restkv.cache import CompressedLayer
from restkv.config import CompressionConfig, ConfigError
from restkv.integrations.transformers.compat import (CHECK_VARIABLE, NEWEST_TESTED, UnsupportedTransformersVersion,
                                                     UntestedTransformersVersion, check_transformers_version,
                                                     output_cache, with_cache)
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.handles import has_class_config, model_state
from restkv.integrations.transformers.patching import (compression, config_of, configure, family_of, replace_family,
                                                       replace_for_model, replace_llama, unpatch)
from restkv.integrations.transformers.reconstruction_prompt import ReconstructionPrompt

_ORIGINAL_LLAMA_FORWARD = LlamaAttention.forward


def test_unpatch_restores_bitwise_identical_outputs():
    original_forward = LlamaAttention.forward
    model = tiny_model("llama")
    prompt = random_prompt(1, 60)
    with torch.no_grad():
        before = model(prompt).logits
        replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4)
        assert LlamaAttention.forward is not original_forward
        unpatch()
        after = model(prompt).logits
    assert LlamaAttention.forward is original_forward
    assert not has_class_config(LlamaAttention)
    assert not any(name.startswith("_restkv") for name in vars(LlamaAttention))
    assert torch.equal(before, after)


def test_configure_changes_one_model_without_repatching():
    first, second = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    replace_llama(method="snapkv", max_capacity_prompts=64)
    configure(first, method="h2o", max_capacity_prompts=16, window_size=4)
    assert config_of(first).method == "h2o" and config_of(first).max_capacity_prompts == 16
    assert config_of(second).method == "snapkv" and config_of(second).max_capacity_prompts == 64
    out = first.generate(random_prompt(1, 60), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert output_cache(out).layers[0].kept_counts.max() == 16


def test_configure_validates_like_the_config():
    model = tiny_model("llama")
    replace_llama(method="snapkv", max_capacity_prompts=64)
    with pytest.raises(ConfigError, match="--window_size 32 must be smaller"):
        configure(model, max_capacity_prompts=32)


def test_configure_needs_a_patched_family():
    with pytest.raises(RuntimeError, match="replace_llama"):
        configure(tiny_model("llama"), max_capacity_prompts=16)


def test_replace_for_model_dispatches_on_model_type():
    model = tiny_model("gemma3")
    config = replace_for_model(model, method="tova", max_capacity_prompts=16)
    assert config_of(model) == config


def test_unsupported_model_type_is_a_clear_error():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported by restkv: GPT2Attention .*o_proj"):
        family_of(model)
    with pytest.raises(ValueError, match="not supported"):
        replace_for_model(model, method="snapkv", max_capacity_prompts=16)


def test_a_model_type_that_is_not_a_decoder_is_a_clear_error():
    from transformers import ViTConfig

    with pytest.raises(ValueError, match="model type 'vit' is not supported by restkv: not a decoder-only"):
        family_of(ViTConfig())


def test_attention_sinks_are_refused_at_patch_time():
    with pytest.raises(ValueError, match="model type 'gpt_oss' is not supported by restkv: .*attention sinks"):
        replace_family("gpt_oss", method="snapkv", max_capacity_prompts=16)


@pytest.mark.parametrize("version", ["4.57.1", "5.21.1"])
def test_transformers_older_than_supported_is_refused(version, monkeypatch):
    monkeypatch.delenv(CHECK_VARIABLE, raising=False)
    with pytest.raises(UnsupportedTransformersVersion, match=f"found {version}.*pip install"):
        check_transformers_version(version)
    monkeypatch.setenv(CHECK_VARIABLE, "warn")  # scripts/check_transformers.sh tries such a release
    with pytest.warns(UntestedTransformersVersion, match=f"found {version}"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.30.0", "6.0.0"])
def test_transformers_newer_than_tested_runs_with_a_one_line_warning(version):
    with pytest.warns(UntestedTransformersVersion) as warned:
        check_transformers_version(version)
    (warning,) = warned
    assert "\n" not in str(warning.message) and f"check_transformers.sh {version}" in str(warning.message)


def test_the_newest_tested_release_and_its_patch_releases_run_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers_version(str(NEWEST_TESTED))
        check_transformers_version(f"{NEWEST_TESTED}.post1")


def test_installed_transformers_is_supported():
    check_transformers_version()


def test_patching_before_loading_works_too():
    replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4)
    model = tiny_model("llama")
    out = model.generate(random_prompt(1, 50), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert isinstance(model, LlamaForCausalLM)
    assert output_cache(out).layers[0].kept_counts.max() == 16


# ---------------------------------------------------------------- setting a fresh config
def test_configure_with_reset_or_a_config_starts_from_nothing():
    model = tiny_model("llama")
    replace_llama(method="snapkv", max_capacity_prompts=32, window_size=4, residual=True)
    kept = configure(model, method="snapkv")
    assert kept.residual is True  # options not given are kept, as documented
    fresh = configure(model, reset=True, method="snapkv", max_capacity_prompts=32, window_size=4)
    assert fresh.residual is False and config_of(model) == fresh
    exact = CompressionConfig(method="fullkv")
    assert configure(model, exact) is exact and config_of(model).method == "fullkv"
    with pytest.raises(ConfigError, match="complete CompressionConfig"):
        configure(model, exact, window_size=8)


def test_compression_context_sets_a_fresh_config_and_restores_the_previous_state():
    import restkv

    model = tiny_model("llama")
    prompt = random_prompt(1, 60)
    with restkv.compression(model, method="snapkv", max_capacity_prompts=16, window_size=4) as config:
        assert config_of(model) == config
        out = model.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
        assert output_cache(out).layers[0].kept_counts.max() == 16
    assert LlamaAttention.forward is _ORIGINAL_LLAMA_FORWARD  # it patched the family, so it unpatched it
    replace_llama(method="h2o", max_capacity_prompts=40, window_size=4)
    configure(model, max_capacity_prompts=24)
    with restkv.compression(model, method="tova", max_capacity_prompts=12):
        assert config_of(model).method == "tova"
    assert config_of(model).method == "h2o" and config_of(model).max_capacity_prompts == 24


def test_a_later_replace_call_overrides_what_configure_set_before_an_unpatch():
    model = tiny_model("llama")
    replace_llama(method="snapkv", max_capacity_prompts=32, window_size=4)
    configure(model, max_capacity_prompts=16)
    unpatch()
    replace_llama(method="h2o", max_capacity_prompts=40, window_size=4)
    assert config_of(model).method == "h2o" and config_of(model).max_capacity_prompts == 40
    out = model.generate(random_prompt(1, 60), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    layer = output_cache(out).layers[0]
    assert layer.kept_counts.max() == 40 and layer.config.method == "h2o"


def test_a_model_of_an_unpatched_family_warns_while_another_family_is_patched():
    from transformers.generation.utils import GenerationMixin

    original_generate = GenerationMixin.generate
    replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4)
    qwen = tiny_model("qwen2")
    with pytest.warns(UserWarning, match="Qwen2ForCausalLM model runs uncompressed: restkv is patched for llama"):
        qwen.generate(random_prompt(1, 30), max_new_tokens=1, pad_token_id=0)
    unpatch()
    import warnings

    assert GenerationMixin.generate is original_generate
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qwen.generate(random_prompt(1, 30), max_new_tokens=1, pad_token_id=0)  # nothing patched: nothing to warn


def test_unpatching_an_unknown_family_names_the_known_ones():
    known = "llama, mistral, qwen2, gemma, any decoder-only model type of transformers"
    with pytest.raises(ValueError, match=f"unknown family 'gpt3'; restkv patches {known}"):
        unpatch("gpt3")


# ----------------------------------------------------------------------------- checked against the model
def _no_forward(model):
    """A pre-hook that fails the test if the model runs: the error must come when configuring."""
    def refuse(module, args, kwargs):
        raise AssertionError("the model ran before the error was found")

    return model.register_forward_pre_hook(refuse, with_kwargs=True)


@pytest.mark.parametrize("options, message", [
    # A memory of 32 features at head dim 16 in float32 takes 17 token slots: 24 - 17 leaves fewer than the window.
    (dict(method="indexmem", max_capacity_prompts=24, window_size=8),
     r"--method indexmem: the latent memory takes 17 token slots per KV head \(--indexmem_features 32, head dim "
     r"16\); a budget of 24 tokens then keeps fewer than the 8 protected ones"),
])
def test_a_budget_the_model_cannot_hold_is_refused_when_configured(options, message):
    """Found at the first generation before; now when the model is given the config."""
    model = tiny_model("llama")
    hook = _no_forward(model)
    replace_llama(method="snapkv", max_capacity_prompts=64)
    for give in (lambda: configure(model, reset=True, **options), lambda: replace_for_model(model, **options),
                 lambda: compression(model, **options).__enter__()):
        with pytest.raises(ConfigError, match=message):
            give()
    hook.remove()


def test_indexmem_weights_for_another_model_shape_are_refused_when_configured(tmp_path):
    from restkv.learned.indexmem import Architecture, IndexMemLayer, IndexMemWeights

    arch = Architecture(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, features=4)
    path = tmp_path / "other.pt"
    IndexMemWeights(arch, [IndexMemLayer(arch, index) for index in range(3)], {}).save(path)
    model = tiny_model("llama")
    hook = _no_forward(model)
    with pytest.raises(ConfigError, match=r"--indexmem_weights .*other.pt was trained for layers/heads/KV heads/head "
                                          r"dim 3/6/2/8; this model has 3/4/2/16"):
        compression(model, method="indexmem", max_capacity_prompts=40, window_size=8, indexmem_features=4,
                    indexmem_weights=str(path)).__enter__()
    hook.remove()


@pytest.mark.parametrize("options, message", [
    (dict(max_capacity_prompts=16, prefill_chunk_size=64),
     r"--prefill_chunk_size 64 compresses full-attention layers again; layers \[0, 2\] have a sliding window of 32 "
     r"tokens, and --max_capacity_prompts 16 keeps fewer than their 31 at the prefill: they would be compressed, "
     r"and a compressed sliding-window layer is not compressed again: raise --max_capacity_prompts to 31"),
    (dict(max_capacity_prompts=16, decode_budget=24, decode_interval=2), r"--decode_budget 24 compresses"),
    (dict(compression_ratio=0.5, prefill_chunk_size=48),
     r"--compression_ratio 0.5 on a prompt of 48 tokens \(one chunk\) keeps fewer than their 31 .*: use chunks of at least "
     r"62 tokens or --max_capacity_prompts 31"),
])
def test_recompression_on_sliding_window_layers_is_refused_when_configured(options, message):
    """A Gemma model whose sliding-window layers would be compressed at prefill could not compress
    them again: a ValueError at the second chunk or the first decode interval, after the load."""
    model = tiny_model("gemma3", sliding_window=32)
    hook = _no_forward(model)
    with pytest.raises(ConfigError, match=message):
        compression(model, method="snapkv", window_size=4, **options).__enter__()
    hook.remove()


def test_a_ratio_budget_under_chunks_keeps_the_sliding_windows_whole_from_a_short_first_chunk():
    """Chunks end at 22, 86 and 150: the 22-token first chunk's ratio budget (11) is below the
    sliding window, which must stay whole (a compressed sliding layer cannot be compressed again)."""
    model = tiny_model("gemma3", sliding_window=32)
    with compression(model, method="snapkv", window_size=4, compression_ratio=0.5, prefill_chunk_size=64):
        out = model.generate(random_prompt(1, 150), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    layers = output_cache(out).layers
    assert [isinstance(layer, CompressedLayer) for layer in layers] == [False, True, False]
    assert layers[1].kept_counts.tolist() == [[75, 75]]


def test_recompression_with_a_budget_that_keeps_the_sliding_windows_whole_runs():
    model = tiny_model("gemma3", sliding_window=32)
    with compression(model, method="snapkv", window_size=4, max_capacity_prompts=31, prefill_chunk_size=64,
                     decode_budget=40):
        out = model.generate(random_prompt(1, 150), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert output_cache(out).layers[1].tokens_seen == 155


def test_no_restkv_attribute_lands_on_a_transformers_object():
    """State rides beside the cache, the model and the classes (restkv.integrations.transformers.handles), not on them:
    a chunked KVzip prefill with a context span and a per-model config leaves none behind."""
    def restkv_names(obj) -> list[str]:
        return [name for name in vars(obj) if "restkv" in name]

    model = tiny_model("llama")
    replace_llama(method="kvzip", max_capacity_prompts=24, prefill_chunk_size=32)
    configure(model, max_capacity_prompts=20)
    model_state(model.model).reconstruction_prompt = ReconstructionPrompt(torch.tensor([5]), torch.tensor([6]),
                                                                           torch.tensor([7]))
    cache = prefill(model, random_prompt(1, 70), context_span=(4, 60))
    kept = torch.stack([layer.kept_counts.float() for layer in cache.layers])
    assert kept.mean() == 20  # configure(model, ...) holds: KVzip spreads 20 per head over layers and heads
    objects = [cache, model, model.model, *model.model.layers, *(layer.self_attn for layer in model.model.layers),
               LlamaAttention, type(model.model)]
    assert not [name for obj in objects for name in restkv_names(obj)]


# ----------------------------------------------------------------------------- any decoder: what is served, what is refused
@pytest.mark.parametrize("model_type, reason", [
    ("doge", r"DogeAttention needs an attention that hands its kernel the attention_mask the model built \(it hands "
             r"attn_mask\)"),
    ("falcon_h1", r"its cache holds LinearAttentionAndFullAttentionLayer layers"),
    ("zamba2", r"its cache holds LinearAttentionAndFullAttentionLayer layers"),
    ("gemma4_text", r"Gemma4TextAttention needs an attention that keeps its keys and values to itself"),
    ("deepseek_v3", r"DeepseekV3Attention needs .*it caches kv_nope, k_rot and hands key_states, value_states"),
])
def test_a_model_type_restkv_cannot_serve_is_refused_at_patch_time_with_its_reason(model_type, reason):
    """Accepted before, then wrong or crashing at the first generate (Doge's learned mask read as none,
    Falcon-H1's convolution state lost with its cache layer, Gemma 4's shared KV fed only new tokens)."""
    with pytest.raises(ValueError, match=f"model type '{model_type}' is not supported by restkv: {reason}"):
        replace_family(model_type, method="snapkv", max_capacity_prompts=16)


def test_a_model_type_is_judged_by_the_attention_its_decoder_builds():
    """Text-only types share a modeling module with a vision or audio tower they never build; types
    named by the auto mappings after another type's classes (internlm3 is LlamaForCausalLM) resolve to
    those classes instead of a module that does not exist."""
    from types import SimpleNamespace

    for model_type in ("llama4_text", "qwen3_5_text", "gemma3n_text"):
        try:
            family_of(SimpleNamespace(model_type=model_type))
        except ValueError as error:
            assert "Vision" not in str(error) and "Audio" not in str(error)
    assert family_of(SimpleNamespace(model_type="internlm3")) == "llama"
    assert family_of(SimpleNamespace(model_type="sarvam_moe")) == "sarvam_moe"
    with pytest.raises(ValueError, match="model type 'data2vec-text' is not supported by restkv: "):
        family_of(SimpleNamespace(model_type="data2vec-text"))


def test_a_hybrid_model_compresses_its_attention_layers_and_reports_its_state_layers():
    """Jamba's Mamba layers hold a state, its attention layers keys: the report and the kept positions read
    both, and a method that reads keys before RoPE runs on attention without RoPE (the identity rotation)."""
    from tiny_models import TINY_JAMBA, tiny_of_type

    from restkv.cache import cache_report, kept_positions

    model = tiny_of_type("jamba", **TINY_JAMBA)
    for method in ("snapkv", "leverage"):
        with compression(model, method=method, max_capacity_prompts=32, window_size=8):
            out = model.generate(random_prompt(1, 90), max_new_tokens=3, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
        cache = output_cache(out)
        reports = cache_report(cache)
        assert [report.kind for report in reports] == ["state", "compressed", "state", "compressed"]
        assert all(report.nbytes > 0 for report in reports)
        positions = kept_positions(cache)
        assert positions[0].exact == [] and [len(head) for head in positions[1].exact[0]] == [34, 34]


def test_compression_configures_only_the_model_it_names():
    """A family patched for one model's block compresses no other model of it, nested blocks included,
    and nothing is left patched or compressed after them."""
    from restkv.cache import cache_report

    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    prompt = random_prompt(1, 90)

    def compressed(which) -> list[bool]:
        out = which.generate(prompt, max_new_tokens=2, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=0)
        return [report.compressed for report in cache_report(output_cache(out))]

    with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):
        assert compressed(model) == [True] * 3 and compressed(other) == [False] * 3
        with compression(other, method="snapkv", max_capacity_prompts=32, window_size=8):
            assert compressed(other) == [True] * 3
        assert compressed(other) == [False] * 3 and compressed(model) == [True] * 3
    assert LlamaAttention.forward is _ORIGINAL_LLAMA_FORWARD and compressed(model) == [False] * 3


def test_a_config_the_model_refuses_leaves_nothing_patched():
    """Qwen3's sliding layer cannot be compressed again under chunks: the block is refused before the family
    is patched, so a later plain generate is the model's own."""
    from restkv.cache import cache_report
    from restkv.integrations.transformers.patching import is_patched

    model = tiny_model("qwen3")
    with pytest.raises(ConfigError, match="--prefill_chunk_size 16 compresses full-attention layers again"):
        with compression(model, method="snapkv", max_capacity_prompts=8, window_size=4, prefill_chunk_size=16):
            pass
    assert not is_patched("qwen3")
    out = model.generate(random_prompt(1, 90), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert not any(report.compressed for report in cache_report(output_cache(out)))


@pytest.mark.parametrize("patch, family", [(replace_llama, "llama"),
                                           (lambda **o: replace_family("phi3", **o), "phi3")])
def test_a_model_of_any_other_family_warns_that_it_runs_uncompressed(patch, family):
    """The warning comes from generate, which restkv watches while a patch is active: it knows discovered
    families too (Qwen3 after replace_llama) and names the patched one."""
    patch(method="snapkv", max_capacity_prompts=16, window_size=4)
    other = tiny_model("qwen3")
    with pytest.warns(UserWarning, match=f"Qwen3ForCausalLM model runs uncompressed: restkv is patched for {family}, "
                                         r"not qwen3\. Call restkv.monkeypatch.replace_family\('qwen3', \.\.\.\)"):
        other.generate(random_prompt(1, 30), max_new_tokens=1, pad_token_id=0)


def test_attention_implementations_restkv_does_not_serve_are_refused():
    """flex_attention and a user's own registered kernel ran uncompressed (or failed at every generate):
    compression() refuses them, and a family patched without the model refuses at the first forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("my_sdpa", sdpa_attention_forward)
    for implementation in ("flex_attention", "my_sdpa"):
        model = tiny_model("llama", attn_implementation=implementation)
        with pytest.raises(ValueError, match=f"restkv serves the eager, sdpa, .*; this model uses '{implementation}'"):
            compression(model, method="snapkv", max_capacity_prompts=32, window_size=8).__enter__()
        replace_llama(method="snapkv", max_capacity_prompts=32, window_size=8)
        with pytest.raises(ValueError, match=f"this model uses '{implementation}'"):
            with torch.no_grad():
                model(random_prompt(1, 40))
        unpatch()


def test_a_subclass_of_a_patched_attention_is_compressed_and_one_overriding_forward_is_named():
    from restkv.cache import cache_report

    class MyAttention(LlamaAttention):
        pass

    class MyForward(LlamaAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    for cls in (MyAttention, MyForward):
        model = tiny_model("llama")
        for layer in model.model.layers:
            swapped = cls(model.config, layer.self_attn.layer_idx)
            swapped.load_state_dict(layer.self_attn.state_dict())
            layer.self_attn = swapped
        if cls is MyForward:
            with pytest.raises(ValueError, match="MyForward overrides forward, so restkv's patch of "
                                                 "LlamaAttention.forward does not reach it"):
                compression(model, method="snapkv", max_capacity_prompts=32, window_size=8).__enter__()
            continue
        with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):
            out = model.generate(random_prompt(1, 90), max_new_tokens=2, do_sample=False,
                                 return_dict_in_generate=True)
        assert all(report.compressed for report in cache_report(output_cache(out)))


@pytest.mark.parametrize("model_type, detail", [
    ("cohere2", "cohere2 layer 0 rotates them in a way restkv does not undo"),
    ("moshi", "moshi layer 0 rotates them in a way restkv does not undo"),
])
def test_a_pre_rope_reader_is_refused_when_configured_where_the_rotation_cannot_be_undone(model_type, detail):
    """Cohere 2 rotates interleaved pairs, Moshi computes its tables inside its attention: the refusal comes
    from compression(), before the first prefill (it came only there before)."""
    from tiny_models import tiny_of_type

    extra = dict(sliding_window=512, layer_types=["sliding_attention", "full_attention", "sliding_attention"]) \
        if model_type == "cohere2" else {}
    model = tiny_of_type(model_type, **extra)
    with pytest.raises(ValueError, match=f"--method leverage reads keys before RoPE; {detail}"):
        compression(model, method="leverage", max_capacity_prompts=32, window_size=8).__enter__()
    with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):  # a post-RoPE scorer runs
        model.generate(random_prompt(1, 60), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_a_forward_without_a_cache_warns_that_nothing_is_compressed():
    model = tiny_model("llama")
    with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):
        with pytest.warns(UserWarning, match=r"restkv: this forward has no cache \(use_cache=False\), so nothing is "
                                             "compressed"):
            model.generate(random_prompt(1, 60), max_new_tokens=2, use_cache=False, pad_token_id=0)


def test_reconstruction_refuses_a_prompt_that_reaches_the_decoder_as_embeddings():
    """An image prompt reaches Gemma 3's text decoder as embeddings: KVzip's reconstruction cannot repeat them,
    and says so (it asked for input_ids the user had given)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=512,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                        image_token_index=299, boi_token_index=297,
                                                        eoi_token_index=298)).eval()
    ids = torch.cat([random_prompt(1, 40), torch.tensor([[297] + [299] * 4 + [298]]), random_prompt(1, 44, seed=3)],
                    dim=1)
    with compression(model, method="kvzip", max_capacity_prompts=32):
        with pytest.raises(ValueError, match=r"--method kvzip.s own\) repeats the context by its token ids; this prefill "
                                             "reached the decoder as embeddings"):
            model.generate(input_ids=ids, pixel_values=torch.randn(1, 3, 28, 28), max_new_tokens=2, do_sample=False)


def test_diffllama_keeps_one_token_set_per_layer_and_reads_each_calls_values_from_their_heads():
    """DiffLlama calls its kernel twice a step, each time with half of the heads' cached values spread over all
    heads: the layer stores the cached values of tokens every head keeps, counts each step once, and a decode
    step equals the unpatched model attending only to the kept tokens (StreamingLLM keeps the same tokens in
    every layer, so one padding-style mask is that oracle)."""
    from tiny_models import tiny_of_type

    from restkv.cache import kept_positions
    from restkv.integrations.transformers.generation import prefill

    model = tiny_of_type("diffllama", num_hidden_layers=2)
    ids = random_prompt(1, 90)
    native = prefill(model, ids)
    with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    layer = output_cache(out).layers[0]
    columns = layer.kept_columns[0]
    assert layer.tokens_seen == 93 and bool((columns == columns[:1]).all())  # one token set for both heads
    kept = columns[0][(columns[0] >= 0) & (columns[0] < 90)].long()
    torch.testing.assert_close(layer.kept_values[0][:, : len(kept)], native.layers[0].values[0][:, kept])

    with compression(model, method="streamingllm", max_capacity_prompts=32, n_sink=4):
        cache = prefill(model, ids)
    visible = torch.zeros(1, 91, dtype=torch.long)
    visible[0, kept_positions(cache)[0].exact[0][0]] = 1
    visible[0, 90] = 1
    token, position = torch.tensor([[7]]), torch.tensor([[90]])
    with torch.no_grad():
        reference = model(token, attention_mask=visible, position_ids=position, **with_cache(native)).logits
        with compression(model, method="streamingllm", max_capacity_prompts=32, n_sink=4):
            ours = model(token, position_ids=position, **with_cache(cache)).logits
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="--residual: diffllama's attention reads each head's values from other "
                                         "heads, so restkv keeps one exact token set per layer there"):
        compression(model, method="snapkv", residual=True, max_capacity_prompts=32, window_size=8).__enter__()


def test_mllama_compresses_its_self_attention_and_leaves_its_cross_attention_native():
    """Mllama's text model: its config names a sub-model type (found by the model's class), its
    cross-attention is not the decoder's own (left native, with no warning), and it reads every cache
    layer's keys, which a compressed layer gives as the tokens it holds."""
    import warnings

    from transformers import MllamaForCausalLM
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig

    from restkv.cache import cache_report

    config = MllamaTextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0)
    torch.manual_seed(0)
    model = MllamaForCausalLM(config).eval()
    assert family_of(model) == "mllama"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with compression(model, method="snapkv", max_capacity_prompts=32, window_size=8):
            out = model.generate(random_prompt(1, 90), max_new_tokens=3, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
    cache = output_cache(out)
    assert [report.compressed for report in cache_report(cache)] == [True, False, True, True]
    layer = cache.layers[0]
    assert layer.keys.shape == (1, 2, 32 + 2, 16) and torch.equal(layer.values, layer.kept_tokens(appended=True)[1])
