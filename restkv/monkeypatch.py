"""Swap each family's attention forward for restkv's shared one.

::

    from restkv.monkeypatch import replace_llama
    replace_llama(method="snapkv", max_capacity_prompts=128)
    model = AutoModelForCausalLM.from_pretrained(...)
    model.generate(input_ids, max_new_tokens=32)     # compresses after the prefill

``replace_*`` sets the default config of every model of that family in the process;
``configure(model, ...)`` changes one model's config without re-patching; ``unpatch()``
restores the original forwards exactly.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from restkv.attention import restkv_attention_forward
from restkv.compat import check_transformers_version
from restkv.config import CompressionConfig

#: family -> attention classes it covers, as (module, class name)
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

#: ``config.model_type`` -> family
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
}

# The only global state: attention class -> its original forward, while patched.
_ORIGINAL_FORWARDS: dict[type, Any] = {}


def _attention_classes(family: str) -> list[type]:
    return [getattr(importlib.import_module(module), name) for module, name in FAMILIES[family]]


def _replace(family: str, method: str, options: dict[str, Any]) -> CompressionConfig:
    check_transformers_version()
    config = CompressionConfig.from_options(method=method, **options)
    for cls in _attention_classes(family):
        if cls not in _ORIGINAL_FORWARDS:
            _ORIGINAL_FORWARDS[cls] = cls.forward
            cls.forward = restkv_attention_forward
        cls._restkv_config = config
    return config


def replace_llama(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Llama attention. ``options`` are ``CompressionConfig`` fields (the original release's
    flag names: ``max_capacity_prompts``, ``window_size``, ``kernel_size``, ``pooling``, ...)."""
    return _replace("llama", method, options)


def replace_mistral(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Mistral attention (see ``replace_llama``)."""
    return _replace("mistral", method, options)


def replace_qwen2(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Qwen2 attention (see ``replace_llama``)."""
    return _replace("qwen2", method, options)


def replace_gemma(method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch Gemma, Gemma 2 and Gemma 3 (text) attention (see ``replace_llama``)."""
    return _replace("gemma", method, options)


REPLACE_FUNCTIONS = {"llama": replace_llama, "mistral": replace_mistral, "qwen2": replace_qwen2, "gemma": replace_gemma}


def family_of(model_or_config: Any) -> str:
    """The patch family of a model (or its config); unsupported model types raise."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported by restkv; supported: {', '.join(sorted(MODEL_TYPES))}"
        )
    return MODEL_TYPES[model_type]


def replace_for_model(model: torch.nn.Module, method: str = "snapkv", **options: Any) -> CompressionConfig:
    """Patch the family ``model`` belongs to (the runners use this)."""
    return REPLACE_FUNCTIONS[family_of(model)](method, **options)


def configure(model: torch.nn.Module, **options: Any) -> CompressionConfig:
    """Change one model's compression config without re-patching.

    Options not given keep the model's current values. The model's family must be patched.
    """
    modules = _patched_attention_modules(model)
    config = modules[0]._restkv_config.replace(**options)
    for module in modules:
        module._restkv_config = config
    return config


def config_of(model: torch.nn.Module) -> CompressionConfig:
    """The config the model's attention layers use now."""
    return _patched_attention_modules(model)[0]._restkv_config


def _patched_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    modules = [m for m in model.modules() if type(m) in _ORIGINAL_FORWARDS]
    if not modules:
        family = family_of(model)
        raise RuntimeError(f"the model's attention is not patched; call restkv.monkeypatch.replace_{family}() first")
    return modules


def unpatch(family: str | None = None) -> None:
    """Restore the original forwards (of one family, or all), exactly."""
    families = [family] if family is not None else list(FAMILIES)
    for name in families:
        for cls in _attention_classes(name):
            if cls in _ORIGINAL_FORWARDS:
                cls.forward = _ORIGINAL_FORWARDS.pop(cls)
                del cls._restkv_config


def is_patched(family: str) -> bool:
    return any(cls in _ORIGINAL_FORWARDS for cls in _attention_classes(family))
