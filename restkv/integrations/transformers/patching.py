"""Patch a family's attention classes and decoder: restkv's seams around the model's own forwards.

::

    from restkv.integrations.transformers.patching import replace_llama
    replace_llama(method="snapkv", max_capacity_prompts=128)
    model = AutoModelForCausalLM.from_pretrained(...)
    model.generate(input_ids, max_new_tokens=32)     # compresses after the prefill

    with restkv.compression(model, method="restkv", max_capacity_prompts=64):
        model.generate(...)                          # this model, this config, restored after

``replace_*`` patches a family and sets the config of every model of that family in the
process (it also replaces what ``configure`` set on single models before). ``configure``
changes one model's config: ``configure(model, max_capacity_prompts=256)`` keeps the
model's other options, ``configure(model, reset=True, method=...)`` or
``configure(model, CompressionConfig(...))`` sets a complete fresh config.
``compression(model, ...)`` is the same fresh config for a ``with`` block, for that model
alone (a family it patches for the block compresses no other model), and restores the
previous state on exit; a config the model cannot run is refused before anything is patched.
``unpatch()`` restores the original forwards exactly.

Patching wraps (never replaces) each attention class's ``forward`` (``recording_forward``) and
its decoder's (``model_forward``), and registers restkv's dispatcher with transformers'
``AttentionInterface`` (``restkv.integrations.transformers.attention``). Families in ``FAMILIES`` are named by the
table; any other decoder-only model type is found through transformers' auto mappings and checked at
patch time for the seams restkv needs (``restkv.integrations.transformers.seams``: a one-line error naming the model
type and why otherwise). A config given with a model (``compression``, ``configure``,
``replace_for_model``) is checked against that model before it runs: its shape, its attention
implementation, its cache layers, and the rotation of its keys where a part reads them before RoPE; what a
part computes from the model itself is computed then (DuoAttention's ``--duo_on_the_fly`` head scores:
the config the model runs names the pattern file they were written to).

While any family is patched, a model of a family that is not (``replace_llama`` then a Qwen3
model) would generate uncompressed without a word: restkv's dispatcher, which every attention
call of every model reaches while a patch is active, warns once per attention class instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from typing import Any, Iterator

import torch

from restkv.cache import CompressedLayer
from restkv.config import CompressionConfig, ConfigError, ModelShape
from restkv.integrations.transformers.attention import model_forward, patched_attention_of, recording_forward
from restkv.integrations.transformers.backend import use_backend, use_native
from restkv.integrations.transformers.capture import SERVED_KERNELS, native_name
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, check_transformers_version, output_cache
from restkv.integrations.transformers.duo_scores import with_model_scores
from restkv.integrations.transformers.handles import (clear_class_config, has_class_config, module_config,
                                                      module_config_entry, restore_module_config, set_class_config,
                                                      set_module_config, switched_decoders)
from restkv.integrations.transformers.rotation import check_pre_rope, probe_rotations
from restkv.integrations.transformers.seams import (UnknownModelType, UnsupportedModel, attention_classes,
                                                    check_cache_layers, derives_values, mapped_model_type)
from restkv.integrations.transformers.steps import check_exact_tokens_only, layer_facts, output_weight

#: the families the release named (``replace_gemma`` covers Gemma 1-3) -> their attention classes, as
#: (module, class name); every other decoder is its model type, found by
#: ``restkv.integrations.transformers.seams.attention_classes``
FAMILIES: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": (("transformers.models.llama.modeling_llama", "LlamaAttention"),),
    "mistral": (("transformers.models.mistral.modeling_mistral", "MistralAttention"),),
    "qwen2": (("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention"),),
    "gemma": (
        ("transformers.models.gemma.modeling_gemma", "GemmaAttention"),
        ("transformers.models.gemma2.modeling_gemma2", "Gemma2Attention"),
        ("transformers.models.gemma3.modeling_gemma3", "Gemma3Attention"),
    ),
}

#: family -> decoder model classes whose forward finishes a prefill that compresses after it
#: (``restkv.integrations.transformers.deferred``), as (module, class name)
MODEL_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "llama": (("transformers.models.llama.modeling_llama", "LlamaModel"),),
    "mistral": (("transformers.models.mistral.modeling_mistral", "MistralModel"),),
    "qwen2": (("transformers.models.qwen2.modeling_qwen2", "Qwen2Model"),),
    "gemma": (
        ("transformers.models.gemma.modeling_gemma", "GemmaModel"),
        ("transformers.models.gemma2.modeling_gemma2", "Gemma2Model"),
        ("transformers.models.gemma3.modeling_gemma3", "Gemma3TextModel"),
    ),
}

#: ``config.model_type`` -> family, for the families of the table (any other model type is its own family,
#: or a table family whose attention classes it uses: ``internlm3`` runs ``LlamaAttention``)
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
}

# The only global state: attention class -> its original forward, while patched; decoder class -> its
# original forward; family -> whether it is patched (for the names the unpatched-family warning gives).
_ORIGINAL_FORWARDS: dict[type, Any] = {}
_ORIGINAL_MODEL_FORWARDS: dict[type, Any] = {}
_PATCHED_FAMILIES: dict[str, tuple[type, ...]] = {}


def _attention_classes(family: str) -> list[type]:
    if family in FAMILIES:
        return _classes(FAMILIES, family)
    try:
        return list(attention_classes(family)[0])
    except UnknownModelType:
        known = ", ".join([*FAMILIES, "any decoder-only model type of transformers"])
        raise ValueError(f"unknown family {family!r}; restkv patches {known}") from None


def _decoder_classes(family: str) -> list[type]:
    return _classes(MODEL_CLASSES, family) if family in MODEL_CLASSES else list(attention_classes(family)[1])


def _attention_modules_of(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    """The model's attention modules of ``family``'s classes (or subclasses), patched or not, in layer order."""
    classes = tuple(_attention_classes(family))
    return sorted((m for m in model.modules() if isinstance(m, classes)), key=lambda m: m.layer_idx)


def _classes(table: dict[str, tuple[tuple[str, str], ...]], family: str) -> list[type]:
    return [getattr(importlib.import_module(module), name) for module, name in table[family]]


def _family_named(family: str) -> str:
    """The family ``replace_family``/``unpatch`` mean by ``family`` (unknown names refused)."""
    if family in FAMILIES:
        return family
    _attention_classes(family)
    return family_of_type(family)


def family_of_type(model_type: str | None) -> str:
    """The patch family of a model type: its ``MODEL_TYPES`` entry, the table family whose attention classes
    it uses, else the type itself when restkv can serve it (``restkv.integrations.transformers.seams``); unsupported
    types raise."""
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    try:
        classes = set(attention_classes(model_type)[0])
    except UnknownModelType:
        raise UnsupportedModel(f"model type {model_type!r} is not supported by restkv: not a decoder-only model type "
                               f"of this transformers (supported: {', '.join(sorted(MODEL_TYPES))} and any decoder "
                               "whose attention uses transformers' registry)") from None
    return next((family for family in FAMILIES if classes <= set(_classes(FAMILIES, family))), model_type)


def family_of(model_or_config: Any) -> str:
    """The patch family of a model (or its config): see ``family_of_type``. A model whose config names a
    sub-model type (``MllamaForCausalLM``'s ``mllama_text_model``) is found by its class instead."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_or_config, torch.nn.Module):
        model_type = mapped_model_type(model_type, type(model_or_config))
    return family_of_type(model_type)


def _replace(family: str, config: CompressionConfig | None) -> None:
    """Patch ``family``'s classes; ``config`` is what every model of the family runs (None: only the
    models given their own config, by ``compression`` or ``configure``)."""
    check_transformers_version()
    classes = _attention_classes(family)
    for cls in classes:
        if cls not in _ORIGINAL_FORWARDS:
            _ORIGINAL_FORWARDS[cls] = cls.forward
            cls.forward = recording_forward(cls.forward)
        set_class_config(cls, config)  # a new patch: per-model configs set before no longer apply
    for cls in _decoder_classes(family):
        if cls not in _ORIGINAL_MODEL_FORWARDS:
            _ORIGINAL_MODEL_FORWARDS[cls] = cls.forward
            cls.forward = _checked_prefill(model_forward(cls.forward))
    _PATCHED_FAMILIES[family] = tuple(classes)
    _watch_unpatched()


class UncompressedPromptWarning(UserWarning):
    """A prompt kept whole because it fits its budget (``--max_capacity_prompts`` at least its length, and no
    layer's allocation keeps less): shown once per budget in a process. The benchmark runners record such samples
    themselves and may filter it (``warnings.filterwarnings("ignore", category=UncompressedPromptWarning)``)."""


#: the budgets a fitting prompt was warned about, so each is said once per process
_WARNED_FITTING: set[int] = set()


def _checked_prefill(forward):
    """A patched decoder model's ``forward``, looking at a prefill before it runs: it refuses one the
    reconstruction observation cannot compress (it repeats one context by its token ids, so it needs the
    ``input_ids`` of one row: found after the whole prefill otherwise), and after it warns once when the
    prompt fitted its budget, so it was kept whole, which would otherwise pass without a word."""

    def checked(self, *args, **kwargs):
        attention = patched_attention_of(self)
        config = module_config(attention) if attention is not None else None
        prompt = _prefill_tokens(args, kwargs) if config is not None else None
        if prompt is not None:
            _refuse_batched_reconstruction(config, prompt, kwargs)
        output = forward(self, *args, **kwargs)
        if prompt is not None:
            _warn_if_kept_whole(config, prompt, kwargs, output)
        return output

    return checked


def _prefill_tokens(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The input ids (or embeddings) of a forward that prefills an empty cache, else None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    if tokens is None or kwargs.get("use_cache") is False or (cache is not None and cache.get_seq_length() > 0):
        return None
    return tokens


def _refuse_batched_reconstruction(config: CompressionConfig, tokens: torch.Tensor, kwargs: dict) -> None:
    length = tokens.shape[1]
    if config.run.observation != "reconstruction" or config.budget_for(length) >= length:
        return
    # deferring_flags() names the reconstruction observation first, as the user chose it
    flag = config.deferring_flags()[0]
    if tokens.dim() == 3:  # inputs_embeds
        raise ConfigError(f"{flag} repeats the context by its token ids; this prefill reached the decoder as "
                          "embeddings (an image or audio prompt, or inputs_embeds), which it cannot repeat: use a "
                          "method that scores with the prompt's own queries")
    if tokens.shape[0] != 1:
        raise ConfigError(f"{flag} compresses one prompt at a time: this prefill has {tokens.shape[0]} rows; give "
                          "input_ids of one row")


def _warn_if_kept_whole(config: CompressionConfig, tokens: torch.Tensor, kwargs: dict, output) -> None:
    """Warn (once per budget) when every row of the prompt fitted ``--max_capacity_prompts`` and the prefill left
    every layer whole. A ratio always removes something; a decode budget compresses the layers later."""
    budget = config.run.max_capacity_prompts
    if budget is None or budget in _WARNED_FITTING or not config.policy.evicts or config.run.decode_budget is not None:
        return
    mask = kwargs.get("attention_mask")
    longest = int(mask.sum(dim=-1).max()) if mask is not None and mask.dim() == 2 else tokens.shape[1]
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values")) or output_cache(output)
    if longest > budget or cache is None or any(isinstance(layer, CompressedLayer) for layer in cache.layers):
        return
    _WARNED_FITTING.add(budget)
    warnings.warn(f"restkv: the prompt ({longest} tokens) fits max_capacity_prompts={budget}, so it is kept whole, "
                  "not compressed; give a smaller budget or compression_ratio= to compress it (said once per budget)",
                  UncompressedPromptWarning, stacklevel=3)


def config_of_call(method: str | CompressionConfig | None, options: dict[str, Any]) -> CompressionConfig:
    """The config a ``replace_*`` call gives: a ``CompressionConfig`` as it is (with no other option), or one
    composed from ``method`` and ``options`` (the release's flat names, or parts as values: ``policy=``...)."""
    if isinstance(method, CompressionConfig):
        if options:
            raise ConfigError(f"a CompressionConfig takes no other option; got {', '.join(sorted(options))}")
        return method
    return CompressionConfig.from_options(**({} if method is None else {"method": method}), **options)


def replace_family(family: str, method: str | CompressionConfig | None = None, **options: Any) -> CompressionConfig:
    """Patch the attention of ``family``: a key of ``FAMILIES`` (the four below) or any decoder-only
    model type restkv can serve (``qwen3``, ``phi3``, ``olmo2``...: ``restkv.integrations.transformers.seams``),
    and give every model of it the config of ``method`` and ``options``: ``CompressionConfig`` options, the
    original release's flag names (``max_capacity_prompts``, ``window_size``, ``kernel_size``, ``pooling``, ...)
    or the parts as values (``policy=SnapKV(kernel_size=7), switches=[ResidualCache()]``); or a whole
    ``CompressionConfig`` given as ``method``. The method defaults to snapkv.

    A model of another family runs uncompressed, with a one-line warning at its first forward.
    What only a model shows (its attention implementation, its cache layers, its RoPE) is checked
    at its first prefill; ``replace_for_model`` and ``compression`` check it before anything runs."""
    family = _family_named(family)
    config = config_of_call(method, options)
    _replace(family, config)
    return config


def replace_llama(method: str | CompressionConfig | None = None, **options: Any) -> CompressionConfig:
    """Patch Llama attention so that every Llama model compresses its KV cache after each prefill; returns the
    config every Llama model now runs.

    ``method`` names a ``--method`` (``restkv.available_methods()``; snapkv if omitted) or is a whole
    ``CompressionConfig``; ``options`` are its options by their flag names (``restkv.describe(method)`` lists
    them): the budget, ``max_capacity_prompts`` (tokens kept per layer and KV head, the observation window
    included) or ``compression_ratio`` (the fraction of each prompt removed), then ``window_size``,
    ``kernel_size``, ``allocation="adakv"``, ``residual=True``..., or the parts as values
    (``policy=SnapKV(kernel_size=7), switches=[ResidualCache()]``). A bad option is a ``ConfigError`` naming it,
    raised here, before any model runs.

    Example::

        from restkv.monkeypatch import replace_llama
        replace_llama(method="snapkv", max_capacity_prompts=128, window_size=32)
        model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.1-8B-Instruct")
        out = model.generate(input_ids, max_new_tokens=64)   # compressed after the prefill

    The patch holds for the process (``unpatch()`` restores transformers' own forwards); a model of another
    family warns once that it runs uncompressed. For one model in a ``with`` block use ``restkv.compression``,
    to change one model's options later ``restkv.configure``; ``replace_family`` patches any other decoder."""
    return replace_family("llama", method, **options)


def replace_mistral(method: str | CompressionConfig | None = None, **options: Any) -> CompressionConfig:
    """Patch Mistral attention: ``replace_llama`` for Mistral models.

    Example: ``replace_mistral(method="restkv", max_capacity_prompts=256)``."""
    return replace_family("mistral", method, **options)


def replace_qwen2(method: str | CompressionConfig | None = None, **options: Any) -> CompressionConfig:
    """Patch Qwen2 attention: ``replace_llama`` for Qwen2 and Qwen2.5 models.

    Example: ``replace_qwen2(method="adakv", compression_ratio=0.75)``."""
    return replace_family("qwen2", method, **options)


def replace_gemma(method: str | CompressionConfig | None = None, **options: Any) -> CompressionConfig:
    """Patch Gemma, Gemma 2 and Gemma 3 (text) attention: ``replace_llama`` for Gemma models.

    Example: ``replace_gemma(method="snapkv", max_capacity_prompts=512)``."""
    return replace_family("gemma", method, **options)


def replace_for_model(model: torch.nn.Module, method: str | CompressionConfig | None = None,
                      **options: Any) -> CompressionConfig:
    """Patch the family ``model`` belongs to and give it the config (as ``replace_family``: a method and
    options, parts as values, or a whole ``CompressionConfig``), after checking the config against the
    model (``check_for_model``); the model runs restkv's attention backend. The runners use this."""
    family = family_of(model)
    modules = _attention_modules_of(model, family)
    config = with_model_scores(model, config_of_call(method, options), modules)
    check_for_model(model, config, modules)
    _replace(family, config)
    for decoder in _decoders_of(model, family):
        use_backend(decoder)
    return config


def shape_of(model: torch.nn.Module) -> ModelShape:
    """The shape of a supported model (layers, heads, KV heads, head dim...), as its attention reads it."""
    return model_shape(_attention_modules_of(model, family_of(model)))


def check_for_model(model: torch.nn.Module, config: CompressionConfig, modules: list[torch.nn.Module]) -> None:
    """Refuse, before ``model`` runs (and before anything is patched), what ``config`` cannot do with it:
    its shape (``CompressionConfig.check_model``), an attention implementation restkv does not serve, cache
    layers a compressed layer cannot replace, what a layer that reads each head's values from other heads
    cannot hold (DiffLlama), and keys rotated in a way restkv cannot undo where a part of the config reads
    them before RoPE."""
    config.check_model(model_shape(modules))
    implementations = sorted({module.config._attn_implementation for module in modules
                              if native_name(module.config._attn_implementation) not in SERVED_KERNELS})
    if implementations:
        raise UnsupportedModel(f"restkv serves the {', '.join(SERVED_KERNELS)} attention implementations; this model "
                               f"uses {', '.join(map(repr, implementations))} (load it with "
                               "attn_implementation='sdpa')")
    if config.policy.evicts:
        check_cache_layers(modules[0].config.model_type, model.config)
        if derives_values(type(modules[0])):
            check_exact_tokens_only(modules[0], config)
    if any(part.pre_rope_flags() for part in config.parts):
        for module, kind in probe_rotations(model, modules).items():
            if kind == "other":
                check_pre_rope(module, config)


def configure(model: torch.nn.Module, config: CompressionConfig | None = None, /, *, reset: bool = False,
              **options: Any) -> CompressionConfig:
    """Change one model's compression config without re-patching; returns the new config.

    * ``configure(model, max_capacity_prompts=256)``: options not given keep the model's
      current values (those no part of the new composition uses are dropped).
    * ``configure(model, reset=True, method="snapkv", ...)``: a complete fresh config from
      the given options alone.
    * ``configure(model, CompressionConfig(...))``: exactly that config.

    The model's family must be patched (``replace_*``, or use ``compression``). The config is checked
    against the model before it is set (a ``ConfigError`` naming the option otherwise). Example::

        replace_llama(method="snapkv", max_capacity_prompts=128)
        configure(model, max_capacity_prompts=512)         # still snapkv, now 512 tokens per head
        configure(model, reset=True, method="kvzip", compression_ratio=0.8)
    """
    modules = _patched_attention_modules(model)
    current = config_of(model)
    if config is not None:
        if options or reset:
            raise ConfigError("configure(model, config) takes a complete CompressionConfig and no other options")
        new = CompressionConfig.from_any(config)
    elif reset or current is None:
        new = CompressionConfig.from_options(**options)
    else:
        new = current.replace(**options)
    return _set_model_config(model, modules, new)


@contextlib.contextmanager
def compression(model: torch.nn.Module, config: CompressionConfig | None = None, /,
                **options: Any) -> Iterator[CompressionConfig]:
    """Compress ``model``'s KV cache inside a ``with`` block; yields the config it runs.

    The options are ``CompressionConfig``'s (``restkv.describe(method)`` lists a method's): a ``method``
    (``restkv.available_methods()``), a budget (``max_capacity_prompts``: tokens per layer and KV head, the
    window included; or ``compression_ratio``: the fraction of each prompt removed) and the method's options,
    or the parts as values (``policy=SnapKV(kernel_size=7), switches=[ResidualCache()]``), or a whole
    ``CompressionConfig`` as the second argument. Inside the block the model runs that complete fresh config
    (nothing is inherited) for every prefill: ``generate``, ``restkv.prefill``, ``generate_after_context``.
    Example::

        with restkv.compression(model, method="kvzip", compression_ratio=0.8):
            answer = model.generate(input_ids, max_new_tokens=32)
            cache = restkv.prefill(model, input_ids)         # the compressed cache itself
        print(restkv.format_report(restkv.cache_report(cache)))   # per layer: tokens seen and kept

    Only this model: if its family was not patched, it is patched for the block with no config of its
    own, so any other model of the family runs natively meanwhile; the model runs restkv's attention
    backend for the block. The config is checked against the model (``check_for_model``) before anything
    is patched, so a refused config leaves nothing behind; on exit everything is as before."""
    if config is not None and options:
        raise ConfigError("compression(model, config) takes a complete CompressionConfig and no other options")
    new = CompressionConfig.from_any(config) if config is not None else CompressionConfig.from_options(**options)
    family = family_of(model)
    attention = _attention_modules_of(model, family)
    new = with_model_scores(model, new, attention)
    check_for_model(model, new, attention)
    patched_here = not is_patched(family)
    if patched_here:
        _replace(family, None)
    switched: list[torch.nn.Module] = []
    try:
        modules = _patched_attention_modules(model)
        previous = [(module, module_config_entry(module)) for module in modules]
        for module in modules:
            set_module_config(module, new)
        try:
            for decoder in _decoders_of(model, family):
                if native_name(decoder.config._attn_implementation) == decoder.config._attn_implementation:
                    use_backend(decoder)
                    switched.append(decoder)
            yield new
        finally:
            for decoder in switched:
                use_native(decoder)
            for module, entry in previous:
                restore_module_config(module, entry)
    finally:
        if patched_here:
            unpatch(family)


def config_of(model: torch.nn.Module) -> CompressionConfig | None:
    """The config the model's attention layers use now (None: patched, but for other models only)."""
    return module_config(_patched_attention_modules(model)[0])


def model_shape(modules: list[torch.nn.Module]) -> ModelShape:
    """What a config is checked against (``CompressionConfig.check_model``), read from a model's
    attention modules in layer order: as the attention forward reads them."""
    first = modules[0]
    weight = output_weight(first)
    element = weight if weight is not None else next(first.parameters())
    return ModelShape(
        num_layers=first.config.num_hidden_layers, num_heads=first.config.num_attention_heads,
        num_kv_heads=first.config.num_key_value_heads, head_dim=first.head_dim, hidden_size=first.config.hidden_size,
        sliding_windows=tuple(layer_facts(module).sliding_window for module in modules),
        element_size=element.element_size(),
    )


def _set_model_config(model: torch.nn.Module, modules: list[torch.nn.Module],
                      config: CompressionConfig) -> CompressionConfig:
    """Give these modules their own config (``config`` as the model runs it: ``with_model_scores``), valid while
    their class's current patch lasts, once it is checked against their model, and switch the model to restkv's
    attention backend; returns that config."""
    config = with_model_scores(model, config, modules)
    check_for_model(model, config, modules)
    for module in modules:
        set_module_config(module, config)
    for decoder in _decoders_of(model, family_of(model)):
        use_backend(decoder)
    return config


def _decoders_of(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    """The model's decoders of ``family`` (``LlamaModel``...), which run its attention: what switches to restkv's
    backend (a multimodal model's vision tower keeps its own)."""
    classes = tuple(_decoder_classes(family))
    return [module for module in model.modules() if isinstance(module, classes)]


def _patched_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules whose classes are patched, in layer order; a subclass that
    overrides the patched ``forward`` is refused (restkv's seams would not see it)."""
    modules = sorted((m for m in model.modules() if has_class_config(type(m))), key=lambda m: m.layer_idx)
    if not modules:
        family = family_of(model)
        call = f"replace_{family}()" if family in FAMILIES else f"replace_family({family!r})"
        raise RuntimeError(f"the model's attention is not patched; call restkv.monkeypatch.{call} first, or use "
                           "restkv.compression(model, ...)")
    for cls in {type(module) for module in modules} - set(_ORIGINAL_FORWARDS):  # subclasses of patched classes
        patched = next(base for base in cls.__mro__ if base in _ORIGINAL_FORWARDS)
        if cls.forward is not patched.forward:
            raise UnsupportedModel(f"{cls.__name__} overrides forward, so restkv's patch of {patched.__name__}.forward "
                             "does not reach it")
    return modules


def unpatch(family: str | None = None) -> None:
    """Restore the original forwards (of one family, or all), exactly."""
    family = None if family is None else _family_named(family)
    families = list(_PATCHED_FAMILIES) if family is None else [family]
    attention = list(_ORIGINAL_FORWARDS) if family is None else _attention_classes(family)
    decoders = list(_ORIGINAL_MODEL_FORWARDS) if family is None else _decoder_classes(family)
    for cls in attention:
        if cls in _ORIGINAL_FORWARDS:
            cls.forward = _ORIGINAL_FORWARDS.pop(cls)
            clear_class_config(cls)
    for cls in decoders:
        if cls in _ORIGINAL_MODEL_FORWARDS:
            cls.forward = _ORIGINAL_MODEL_FORWARDS.pop(cls)
    for decoder in switched_decoders():  # the models restkv switched run their own attention again
        if isinstance(decoder, tuple(decoders)):
            use_native(decoder)
    for name in families:
        _PATCHED_FAMILIES.pop(name, None)
    _watch_unpatched()


def is_patched(family: str) -> bool:
    return any(cls in _ORIGINAL_FORWARDS for cls in _attention_classes(family))


#: ``GenerationMixin.generate`` as transformers defined it, while restkv wraps it (any family patched)
_ORIGINAL_GENERATE: dict[str, Any] = {}


def _watch_unpatched() -> None:
    """While a family is patched, ``generate`` of a model that restkv does not patch warns once per model class
    that it runs uncompressed (``replace_llama()`` then a Qwen3 model); with nothing patched it is transformers'
    own again."""
    from transformers.generation.utils import GenerationMixin

    if _PATCHED_FAMILIES and not _ORIGINAL_GENERATE:
        _ORIGINAL_GENERATE["generate"] = GenerationMixin.generate
        GenerationMixin.generate = _warning_generate(GenerationMixin.generate)
    elif not _PATCHED_FAMILIES and _ORIGINAL_GENERATE:
        GenerationMixin.generate = _ORIGINAL_GENERATE.pop("generate")


def _warning_generate(original):
    warned: set[type] = set()

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if type(self) not in warned and not any(has_class_config(type(module)) for module in self.modules()):
            warned.add(type(self))
            model_type = getattr(self.config, "model_type", None)
            warnings.warn(
                f"restkv: this {type(self).__name__} model runs uncompressed: restkv is patched for "
                f"{', '.join(sorted(_PATCHED_FAMILIES))}, not {model_type}. Call "
                f"restkv.monkeypatch.replace_family({model_type!r}, ...) or use restkv.compression(model, ...)",
                UserWarning, stacklevel=2)
        return original(self, *args, **kwargs)

    return generate
