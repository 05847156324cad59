"""restkv's attention backend: registered with transformers' public interfaces as ``restkv_<name>`` over each
attention implementation it serves, and the switch of a model to it.

``register_backends`` registers, once, ``restkv_eager``, ``restkv_sdpa`` and ``restkv_flash_attention_2/3/4`` (where
transformers has them), each with its implementation's mask function; transformers' own names stay its own, so
no other model is touched. ``use_backend`` switches a decoder model to the backend over its implementation with
``set_attn_implementation`` (``use_native`` switches it back). The backend's dispatcher hands a module whose
forward noted a step (``restkv.integrations.transformers.steps``) to ``run_step``; any other call (a vision tower,
a model ``compression`` did not name) goes to the native kernel.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from restkv.integrations.transformers.capture import (BACKEND_PREFIX, CAPTURES, SERVED_KERNELS, Captured, backend_name,
                                                      native_name)
from restkv.integrations.transformers.handles import forget_switched, note_switched
from restkv.integrations.transformers.seams import UnsupportedModel
from restkv.integrations.transformers.steps import ACTIVE, run_step

#: attention class -> its family's eager function
_FAMILY_EAGER: dict[type, Callable] = {}


def register_backends() -> None:
    """Register restkv's attention backend with transformers' public interfaces, once, as ``restkv_<name>`` for
    each implementation it serves that this transformers has (with that implementation's mask function). A model
    runs it once switched with ``set_attn_implementation`` (``restkv.integrations.transformers.patching``); the
    built-in names stay transformers' own, so every other model is untouched."""
    for name in SERVED_KERNELS:
        if backend_name(name) in ALL_ATTENTION_FUNCTIONS.valid_keys() or \
                (name != "eager" and name not in ALL_ATTENTION_FUNCTIONS.valid_keys()):
            continue
        AttentionInterface.register(backend_name(name), _dispatcher(name))
        AttentionMaskInterface.register(backend_name(name), ALL_MASK_ATTENTION_FUNCTIONS[name])


def check_served(implementation: str) -> None:
    """Refuse an attention implementation restkv does not serve (flex attention, a user's own)."""
    if native_name(implementation) not in SERVED_KERNELS:
        raise UnsupportedModel(f"restkv serves the {', '.join(SERVED_KERNELS)} attention implementations; this model "
                               f"uses {implementation!r} (load it with attn_implementation='sdpa')")


def check_backend(implementation: str) -> None:
    """Refuse a configured attention that would not reach restkv's backend: an implementation restkv does not
    serve, or a served one the model was not switched from (its decoder's forward, ``restkv.compression``,
    ``configure`` and ``replace_for_model`` switch it)."""
    check_served(implementation)
    if not implementation.startswith(BACKEND_PREFIX):
        raise UnsupportedModel(f"this attention runs {implementation!r}, not restkv's backend "
                               f"{backend_name(implementation)!r}: run it through its model (restkv.compression(model, "
                               "...) switches it)")


def use_backend(decoder: torch.nn.Module) -> None:
    """Switch a decoder model (a ``PreTrainedModel`` whose ``layers`` hold patched attention) to restkv's backend
    over its implementation, with transformers' ``set_attn_implementation``; idempotent. ``use_native`` undoes it."""
    current = decoder.config._attn_implementation
    if current.startswith(BACKEND_PREFIX):
        return
    check_served(current)
    decoder.set_attn_implementation(backend_name(current))
    note_switched(decoder, current)


def use_native(decoder: torch.nn.Module) -> None:
    """Give a decoder model back the implementation it ran before ``use_backend`` (nothing if not switched)."""
    native = forget_switched(decoder)
    if native is not None:
        decoder.set_attn_implementation(native)


def native_kernel(name: str, module: torch.nn.Module) -> Callable:
    """The native function of implementation ``name`` for ``module``: eager is the family's own."""
    native = ALL_ATTENTION_FUNCTIONS.get(name) if name != "eager" else None
    if native is not None:
        return native
    cls = type(module)
    if cls not in _FAMILY_EAGER:
        eager = getattr(sys.modules[cls.__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"restkv: {cls.__name__} has no eager_attention_forward; use attn_implementation='sdpa'")
        _FAMILY_EAGER[cls] = eager
    return _FAMILY_EAGER[cls]


def _dispatcher(name: str) -> Callable:
    """restkv's backend over native implementation ``name``: a noted step goes to ``steps.run_step``,
    anything else (a module of an unconfigured model, a vision tower) to the native kernel."""

    def dispatch(module, query, key, value, attention_mask, **kwargs):
        captured = CAPTURES.get(module)
        if captured is not None:
            captured.extend((query, key, value))
            raise Captured
        native = native_kernel(name, module)
        step = ACTIVE.get(module)
        if step is None:
            return native(module, query, key, value, attention_mask, **kwargs)
        return run_step(module, step, native, query, key, value, attention_mask, kwargs)

    dispatch.__name__ = dispatch.__qualname__ = backend_name(name)
    return dispatch


register_backends()
