"""What restkv keeps about transformers objects it does not own, kept beside them, not on them.

A cache's prefill state (layers waiting for the whole prefill, the rows of a chunked prompt,
where the context lies) and a model's reconstruction prompt live in weak maps keyed by the
object: no ``_restkv_*`` attribute lands on a transformers cache or model, and an entry goes
when its object does. ``copy.copy`` of a cache does not carry its state (nothing copies a
cache during a prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary


@dataclass
class CacheState:
    """One cache's prefill state."""

    #: layers waiting for the whole prefill (``restkv.integrations.transformers.deferred.PendingPrefill``)
    pending: Any = None
    #: each row's real tokens while the cache reads a prompt in chunks (``--prefill_chunk_size``)
    chunked_prompt: list[int] | None = None
    #: where the context lies in the prompt (``restkv.integrations.transformers.context_span``)
    context_span: tuple[int, int] | None = None
    #: tokens the caller will append after the prefill (question and answer), when it knows: each
    #: compressed layer then holds room for exactly them (``restkv.integrations.transformers.generation``)
    expected_appends: int | None = None
    #: each row's column of the question delimiter its prompt held, taken out before the model ran
    #: (``restkv.integrations.transformers.question_window``), or None
    question_columns: Any = None


@dataclass
class ModelState:
    """One decoder model's settings that outlive a prefill."""

    #: the pieces of the reconstruction prompt (``restkv.integrations.transformers.reconstruction_prompt``)
    reconstruction_prompt: Any = None


_CACHES: WeakKeyDictionary = WeakKeyDictionary()
_MODELS: WeakKeyDictionary = WeakKeyDictionary()


def cache_state(cache) -> CacheState:
    """``cache``'s state, created empty on first use."""
    state = _CACHES.get(cache)
    if state is None:
        state = _CACHES[cache] = CacheState()
    return state


#: decoder model -> the attention implementation it ran before restkv switched it to its backend
_SWITCHED: WeakKeyDictionary = WeakKeyDictionary()


def note_switched(decoder, implementation: str) -> None:
    """``decoder`` now runs restkv's backend; it ran ``implementation`` before."""
    _SWITCHED.setdefault(decoder, implementation)


def forget_switched(decoder) -> str | None:
    """The implementation ``decoder`` ran before restkv switched it (None: not switched), forgotten."""
    return _SWITCHED.pop(decoder, None)


def switched_decoders() -> list:
    """The decoder models restkv switched to its backend that are still alive."""
    return list(_SWITCHED.keys())


def model_state(model) -> ModelState:
    """The decoder model's state, created empty on first use."""
    state = _MODELS.get(model)
    if state is None:
        state = _MODELS[model] = ModelState()
    return state


# ---------------------------------------------------------------- which config a patched attention runs
#: patched attention class -> (its family's config from ``replace_*``, or None when it was patched for the
#: models ``compression`` or ``configure`` name alone; a token of that patch)
_CLASS_CONFIGS: dict[type, tuple[Any, object]] = {}
#: attention module -> (its model's own config from ``configure``, the class's patch token then)
_MODULE_CONFIGS: WeakKeyDictionary = WeakKeyDictionary()


def set_class_config(cls: type, config) -> None:
    """A new patch of ``cls``: per-model configs set before it no longer apply."""
    _CLASS_CONFIGS[cls] = (config, object())


def clear_class_config(cls: type) -> None:
    _CLASS_CONFIGS.pop(cls, None)


def _class_entry(cls: type):
    """The patch entry of ``cls`` or of the nearest patched class it derives from (a user's subclass of
    ``LlamaAttention`` runs the patched forward it inherits), or None."""
    return next((_CLASS_CONFIGS[base] for base in cls.__mro__ if base in _CLASS_CONFIGS), None)


def has_class_config(cls: type) -> bool:
    """Whether ``cls`` (or a class it derives from) is patched."""
    return _class_entry(cls) is not None


def module_config_entry(module):
    """What ``set_module_config`` gave ``module`` (for ``restore_module_config``), or None."""
    return _MODULE_CONFIGS.get(module)


def set_module_config(module, config) -> None:
    """Give ``module`` its own config, valid while its class's current patch lasts."""
    _MODULE_CONFIGS[module] = (config, _class_entry(type(module))[1])


def restore_module_config(module, entry) -> None:
    """Put back what ``module_config_entry`` read (None: the module had no config of its own)."""
    if entry is None:
        _MODULE_CONFIGS.pop(module, None)
    else:
        _MODULE_CONFIGS[module] = entry


def module_config(module):
    """The config a patched attention module runs: its model's own (``configure``), if set since
    its class was last patched, else the class's (``replace_*``); None when neither applies (an
    unpatched class, or a model that ``compression`` did not name): the module then runs natively."""
    entry = _class_entry(type(module))
    if entry is None:
        return None
    family_config, token = entry
    own = _MODULE_CONFIGS.get(module)
    return own[0] if own is not None and own[1] is token else family_config
