"""Patch a family's attention classes and decoder: restkv's seams around the model's own forwards.

::

    from restkv.monkeypatch import replace_llama
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
``compression(model, ...)`` is the same fresh config for a ``with`` block, patching the
model's family if needed, and restores the previous state on exit. ``unpatch()`` restores
the original forwards exactly.

Patching wraps (never replaces) each attention class's ``forward`` (``recording_forward``) and
its decoder's (``model_forward``), and registers restkv's dispatcher with transformers'
``AttentionInterface`` (``restkv.attention``). Families in ``FAMILIES`` are named by the table;
any other decoder-only model type is found through transformers' auto mappings (its modeling
module's ``*Attention`` classes and base model), and must pass ``check_seams``: attention that
calls ``cache.update`` and a registry kernel, with an ``o_proj``.

While any family is patched, a model of a family that is not (``replace_llama`` then a Qwen2
model) would generate uncompressed without a word: its attention warns once instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import warnings
from typing import Any, Iterator

import torch

from restkv.attention import LayerParams, install_dispatchers, model_forward, recording_forward, remove_dispatchers
from restkv.compat import CACHE_ARGUMENT, check_transformers_version
from restkv.config import CompressionConfig, ConfigError, ModelShape
from restkv.handles import (clear_class_config, module_config, module_config_entry, restore_module_config,
                            set_class_config, set_module_config)

#: the families the release named (``replace_gemma`` covers Gemma 1-3) -> their attention classes, as
#: (module, class name); every other decoder is its model type, found by ``discovered_family``
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
#: (``restkv.deferred``), as (module, class name)
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

#: ``config.model_type`` -> family, for the families of the table (any other model type is its own family)
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
}

# The only global state: attention class -> its original forward, while patched (or watched:
# the forward of an unpatched family that warns while another family is patched).
_ORIGINAL_FORWARDS: dict[type, Any] = {}
_WATCHED_FORWARDS: dict[type, Any] = {}
_ORIGINAL_MODEL_FORWARDS: dict[type, Any] = {}


def _attention_classes(family: str) -> list[type]:
    return _classes(FAMILIES, family) if family in FAMILIES else list(discovered_family(family)[0])


def _decoder_classes(family: str) -> list[type]:
    return _classes(MODEL_CLASSES, family) if family in MODEL_CLASSES else list(discovered_family(family)[1])


def _attention_modules_of(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    """The model's attention modules of ``family``'s classes, patched or not, in layer order."""
    classes = tuple(_attention_classes(family))
    return sorted((m for m in model.modules() if isinstance(m, classes)), key=lambda m: m.layer_idx)


def _classes(table: dict[str, tuple[tuple[str, str], ...]], family: str) -> list[type]:
    return [getattr(importlib.import_module(module), name) for module, name in table[family]]


@functools.cache
def discovered_family(model_type: str) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """``(attention classes, decoder classes)`` of a decoder-only model type outside ``FAMILIES``,
    found through transformers' auto mappings and checked (``check_seams``)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in MODEL_MAPPING_NAMES:
        known = ", ".join([*FAMILIES, "any decoder-only model type of transformers"])
        raise ValueError(f"unknown family {model_type!r}; restkv patches {known}")
    name = model_type_to_module_name(model_type)
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    attention = tuple(cls for cls in vars(modeling).values() if isinstance(cls, type) and
                      issubclass(cls, torch.nn.Module) and cls.__module__ == modeling.__name__ and
                      cls.__name__.endswith("Attention"))
    if not attention:
        raise ValueError(f"model type {model_type!r} is not supported by restkv: its modeling module has no "
                         "attention class")
    for cls in attention:
        check_seams(model_type, cls)
    return attention, (getattr(modeling, MODEL_MAPPING_NAMES[model_type]),)


def check_seams(model_type: str, cls: type) -> None:
    """Refuse an attention class restkv cannot serve through transformers' seams, naming the model type."""
    source = inspect.getsource(cls)
    needs = {
        "calls an attention function of transformers' registry": "ALL_ATTENTION_FUNCTIONS.get_interface(" in source,
        "writes its cache through cache.update": ".update(key_states, value_states, self.layer_idx" in source,
        "has an o_proj output projection": "self.o_proj" in source,
        "has no attention sinks (restkv's compressed attention does not read them)": "s_aux=" not in source,
    }
    missing = [need for need, met in needs.items() if not met]
    if missing:
        raise ValueError(f"model type {model_type!r} is not supported by restkv: {cls.__name__} needs an attention "
                         f"that {'; '.join(missing)}")


def _replace(family: str, config: CompressionConfig) -> CompressionConfig:
    check_transformers_version()
    classes = _attention_classes(family)
    install_dispatchers()
    for cls in classes:
        if cls in _WATCHED_FORWARDS:
            cls.forward = _WATCHED_FORWARDS.pop(cls)
        if cls not in _ORIGINAL_FORWARDS:
            _ORIGINAL_FORWARDS[cls] = cls.forward
            cls.forward = recording_forward(cls.forward)
        set_class_config(cls, config)  # a new patch: per-model configs set before no longer apply
    for cls in _decoder_classes(family):
        if cls not in _ORIGINAL_MODEL_FORWARDS:
            _ORIGINAL_MODEL_FORWARDS[cls] = cls.forward
            cls.forward = _one_row_reconstruction(model_forward(cls.forward))
    _watch_unpatched_families()
    return config


def _one_row_reconstruction(forward):
    """A patched decoder model's ``forward``, refusing before it runs a prefill that the
    reconstruction observation cannot compress: it repeats one context, so it needs the
    ``input_ids`` of one row (found after the whole prefill otherwise)."""

    def checked(self, *args, **kwargs):
        attention = getattr(self.layers[0], "self_attn", None) if len(self.layers) else None
        if attention is not None and type(attention) in _ORIGINAL_FORWARDS:
            _refuse_batched_reconstruction(module_config(attention), args, kwargs)
        return forward(self, *args, **kwargs)

    return checked


def _refuse_batched_reconstruction(config: CompressionConfig, args: tuple, kwargs: dict) -> None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    prefill = tokens is not None and kwargs.get("use_cache") is not False and (cache is None or
                                                                               cache.get_seq_length() == 0)
    if config.run.observation != "reconstruction" or not prefill:
        return
    length = tokens.shape[1]
    if config.budget_for(length) < length and (ids is None or ids.shape[0] != 1):
        given = "inputs_embeds, not input_ids" if ids is None else f"{ids.shape[0]} rows"
        # deferring_flags() names the reconstruction observation first, as the user chose it
        raise ValueError(f"{config.deferring_flags()[0]} compresses one prompt at a time: this prefill has {given}; "
                         "give input_ids of one row")


def replace_family(family: str, method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch the attention of ``family``: a key of ``FAMILIES`` (the four below) or any decoder-only
    model type that passes ``check_seams`` (``qwen3``, ``phi3``, ``olmo2``...). ``options`` are ``CompressionConfig`` options (the original release's flag
    names: ``max_capacity_prompts``, ``window_size``, ``kernel_size``, ``pooling``, ...)."""
    _attention_classes(family)  # an unknown or unsupported family is the first error
    return _replace(family, CompressionConfig.from_options(method=method, **options))


def replace_llama(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Llama attention (see ``replace_family``)."""
    return replace_family("llama", method, **options)


def replace_mistral(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Mistral attention (see ``replace_llama``)."""
    return replace_family("mistral", method, **options)


def replace_qwen2(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Qwen2 attention (see ``replace_llama``)."""
    return replace_family("qwen2", method, **options)


def replace_gemma(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Gemma, Gemma 2 and Gemma 3 (text) attention (see ``replace_llama``)."""
    return replace_family("gemma", method, **options)


def family_of(model_or_config: Any) -> str:
    """The patch family of a model (or its config): its ``MODEL_TYPES`` entry, else its model type
    when that passes ``check_seams``; unsupported model types raise."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    try:
        discovered_family(model_type)
    except ValueError as error:
        if "is not supported" in str(error):
            raise
        raise ValueError(f"model type {model_type!r} is not supported by restkv: not a decoder-only model type of "
                         f"this transformers (supported: {', '.join(sorted(MODEL_TYPES))} and any decoder whose "
                         "attention uses transformers' registry)") from None
    return model_type


def replace_for_model(model: torch.nn.Module, method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch the family ``model`` belongs to (the runners use this), after checking the config
    against the model (``CompressionConfig.check_model``)."""
    family = family_of(model)
    config = CompressionConfig.from_options(method=method, **options)
    config.check_model(shape_of(model))
    return _replace(family, config)


def shape_of(model: torch.nn.Module) -> ModelShape:
    """The shape of a supported model (layers, heads, KV heads, head dim...), as its attention reads it."""
    return model_shape(_attention_modules_of(model, family_of(model)))


def configure(model: torch.nn.Module, config: CompressionConfig | None = None, /, *, reset: bool = False,
              **options: Any) -> CompressionConfig:
    """Change one model's compression config without re-patching; returns the new config.

    * ``configure(model, max_capacity_prompts=256)``: options not given keep the model's
      current values (those no part of the new composition uses are dropped).
    * ``configure(model, reset=True, method="snapkv", ...)``: a complete fresh config from
      the given options alone.
    * ``configure(model, CompressionConfig(...))``: exactly that config.

    The model's family must be patched (``replace_*``, or use ``compression``).
    """
    modules = _patched_attention_modules(model)
    if config is not None:
        if options or reset:
            raise ConfigError("configure(model, config) takes a complete CompressionConfig and no other options")
        new = CompressionConfig.from_any(config)
    elif reset:
        new = CompressionConfig.from_options(**options)
    else:
        new = config_of(model).replace(**options)
    _set_model_config(modules, new)
    return new


@contextlib.contextmanager
def compression(model: torch.nn.Module, config: CompressionConfig | None = None, /,
                **options: Any) -> Iterator[CompressionConfig]:
    """``with compression(model, method="snapkv", max_capacity_prompts=128) as config:`` — the model
    runs a complete fresh config inside the block (``config`` or the options; nothing is
    inherited), its family patched if it was not, and everything is as before afterwards."""
    if config is not None and options:
        raise ConfigError("compression(model, config) takes a complete CompressionConfig and no other options")
    new = CompressionConfig.from_any(config) if config is not None else CompressionConfig.from_options(**options)
    family = family_of(model)
    patched_here = not is_patched(family)
    if patched_here:
        _replace(family, new)
    modules = _patched_attention_modules(model)
    previous = [(module, module_config_entry(module)) for module in modules]
    _set_model_config(modules, new)
    try:
        yield new
    finally:
        if patched_here:
            unpatch(family)
        for module, entry in previous:
            restore_module_config(module, entry)


def config_of(model: torch.nn.Module) -> CompressionConfig:
    """The config the model's attention layers use now."""
    return module_config(_patched_attention_modules(model)[0])


def model_shape(modules: list[torch.nn.Module]) -> ModelShape:
    """What a config is checked against (``CompressionConfig.check_model``), read from a model's
    attention modules in layer order: as the attention forward reads them."""
    first = modules[0]
    return ModelShape(
        num_layers=first.config.num_hidden_layers, num_heads=first.config.num_attention_heads,
        num_kv_heads=first.config.num_key_value_heads, head_dim=first.head_dim, hidden_size=first.config.hidden_size,
        sliding_windows=tuple(LayerParams.of(module).sliding_window for module in modules),
        element_size=first.o_proj.weight.element_size(),
    )


def _set_model_config(modules: list[torch.nn.Module], config: CompressionConfig) -> None:
    """Give these modules their own config, valid while their class's current patch lasts, once
    it is checked against their model."""
    config.check_model(model_shape(modules))
    for module in modules:
        set_module_config(module, config)


def _patched_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    modules = sorted((m for m in model.modules() if type(m) in _ORIGINAL_FORWARDS), key=lambda m: m.layer_idx)
    if not modules:
        family = family_of(model)
        raise RuntimeError(f"the model's attention is not patched; call restkv.monkeypatch.replace_{family}() first")
    return modules


def unpatch(family: str | None = None) -> None:
    """Restore the original forwards (of one family, or all), exactly."""
    attention = list(_ORIGINAL_FORWARDS) if family is None else _attention_classes(family)
    decoders = list(_ORIGINAL_MODEL_FORWARDS) if family is None else _decoder_classes(family)
    for cls in attention:
        if cls in _ORIGINAL_FORWARDS:
            cls.forward = _ORIGINAL_FORWARDS.pop(cls)
            clear_class_config(cls)
    for cls in decoders:
        if cls in _ORIGINAL_MODEL_FORWARDS:
            cls.forward = _ORIGINAL_MODEL_FORWARDS.pop(cls)
    if not _ORIGINAL_FORWARDS:
        remove_dispatchers()
    _watch_unpatched_families()


def is_patched(family: str) -> bool:
    return any(cls in _ORIGINAL_FORWARDS for cls in _attention_classes(family))


# ---------------------------------------------------------------- families left unpatched
def _watch_unpatched_families() -> None:
    """While some family is patched, every other family's attention warns at its first forward;
    when none is, every forward is the original again."""
    for family in FAMILIES:
        for cls in _attention_classes(family):
            watch = bool(_ORIGINAL_FORWARDS) and cls not in _ORIGINAL_FORWARDS
            if watch and cls not in _WATCHED_FORWARDS:
                _WATCHED_FORWARDS[cls] = cls.forward
                cls.forward = _warning_forward(cls.forward, family)
            elif not watch and cls in _WATCHED_FORWARDS:
                cls.forward = _WATCHED_FORWARDS.pop(cls)


def _warning_forward(original, family: str):
    """``original``, warning once that this family runs uncompressed while another is patched."""
    warned = []

    def forward(self, *args, **kwargs):
        if not warned:
            warned.append(True)
            patched = sorted({name for name in FAMILIES if is_patched(name)})
            warnings.warn(
                f"restkv: this {type(self).__name__} model runs uncompressed: restkv is patched for "
                f"{', '.join(patched)}, not {family}. Call restkv.monkeypatch.replace_{family}(...) or use "
                "restkv.compression(model, ...)",
                UserWarning,
                stacklevel=2,
            )
        return original(self, *args, **kwargs)

    return forward
