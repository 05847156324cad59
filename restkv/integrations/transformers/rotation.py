"""How each layer turns its keys, probed from its own forward, and the refusals of readers of pre-RoPE keys
where the rotation cannot be undone.

``layer_rotary`` gives scorers the tables ``restkv.scoring.rope`` turns a layer with: the forward's own for
``rotate_half`` RoPE, the identity for a layer without RoPE (SmolLM3's NoPE layers, Cohere 2's full ones,
Jamba), none for a rotation restkv does not undo (interleaved pairs, partial RoPE, tables an attention computes
itself). ``probe_rotations`` finds every layer's kind with one token before a model compresses anything.
"""

from __future__ import annotations

import inspect
import math
import warnings
from weakref import WeakKeyDictionary

import torch

from restkv.config.options import ConfigError
from restkv.integrations.transformers.capture import attention_inputs
from restkv.scoring.rope import rotate

#: attention module -> how its forward turns keys: "rotate_half", "none" or "other" (probed once)
_ROTATIONS: WeakKeyDictionary = WeakKeyDictionary()
#: relative difference below which two probed keys are the same (bfloat16 rounding is ~0.4%)
_PROBE_TOLERANCE = 0.02


def layer_rotary(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor, head_dim: int):
    """The ``(cos, sin)`` ``[B, n, head_dim]`` that ``restkv.scoring.rope`` turns this layer's queries and keys with:
    the forward's own tables where the module rotates as ``apply_rotary_pos_emb`` does over every channel,
    the identity where it does not rotate at all (SmolLM3's NoPE layers, Cohere 2's full-attention layers,
    Jamba's attention, which takes no tables), None where it rotates otherwise (interleaved pairs, part of the
    channels, tables it computes itself), which ``restkv.scoring.rope`` cannot undo (``check_pre_rope`` refuses the
    methods that would need it)."""
    kind = _ROTATIONS.get(module)
    if kind is None:
        kind = _ROTATIONS[module] = _probe_rotation(module, position_embeddings, hidden_states)
    if kind == "rotate_half":
        return position_embeddings
    if kind == "none":
        like = position_embeddings[0] if isinstance(position_embeddings, tuple) else hidden_states
        shape = (*like.shape[:2], head_dim)
        return (torch.ones(shape, dtype=like.dtype, device=like.device),
                torch.zeros(shape, dtype=like.dtype, device=like.device))
    return None


def probe_rotations(model: torch.nn.Module, modules: list[torch.nn.Module]) -> dict[torch.nn.Module, str]:
    """How each of ``modules`` turns its keys (``layer_rotary``'s kinds), probed before the model compresses
    anything: one forward of one token, without a cache, hands every module its tables; each module's own
    forward is then probed with them. Empty when the model cannot run that forward (the prefill checks then)."""
    captured: dict[torch.nn.Module, tuple] = {}

    def note(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        captured[module] = (kwargs.get("position_embeddings"), hidden)

    hooks = [module.register_forward_pre_hook(note, with_kwargs=True) for module in modules]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    except Exception:
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    for module, (position_embeddings, hidden) in captured.items():
        if module not in _ROTATIONS and hidden is not None:
            _ROTATIONS[module] = _probe_rotation(module, position_embeddings, hidden)
    return {module: _ROTATIONS[module] for module in captured if module in _ROTATIONS}


def _probe_rotation(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor) -> str:
    """How ``module`` turns its keys, read from its own forward on one random token: with tables of angle
    0 and of angle 1 on every channel, and compared with ``restkv.scoring.rope.rotate``. A module handed no tables
    rotates nothing unless its forward computes tables itself (from position ids: Moshi)."""
    if not isinstance(position_embeddings, tuple) or len(position_embeddings) != 2:
        source = inspect.getsource(inspect.unwrap(type(module).forward))
        return "other" if "rotary" in source or "position_ids" in source else "none"
    cos = position_embeddings[0]
    generator = torch.Generator().manual_seed(0)
    token = torch.randn(1, 1, hidden_states.shape[-1], generator=generator).to(hidden_states)

    def keys_at(angle: float) -> torch.Tensor:
        tables = tuple(torch.full((1, 1, cos.shape[-1]), value, dtype=cos.dtype, device=cos.device)
                       for value in (math.cos(angle), math.sin(angle)))
        with torch.no_grad():
            return attention_inputs(module, token, tables)[1].float()

    def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        return bool((ours - theirs).norm() <= _PROBE_TOLERANCE * theirs.norm())

    plain, turned = keys_at(0.0), keys_at(1.0)
    if same(plain, turned):
        return "none"
    if cos.shape[-1] == plain.shape[-1]:
        angle = torch.full((1, 1, plain.shape[-1]), 1.0, device=plain.device)
        if same(rotate(plain, angle.cos(), angle.sin()), turned):
            return "rotate_half"
    return "other"


def undoable_rotary(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor, head_dim: int):
    """``layer_rotary``, for a reader that cannot do without pre-RoPE queries and keys: a one-line
    ``ConfigError`` (the model cannot serve the reader; commands report it as such) naming the model
    type and layer where the rotation cannot be undone."""
    rotary = layer_rotary(module, position_embeddings, hidden_states, head_dim)
    if rotary is None:
        raise ConfigError(f"no pre-RoPE queries and keys: {_rotation_not_undone(module)}")
    return rotary


def check_pre_rope(module: torch.nn.Module, config) -> None:
    """Refuse a method that reads keys or queries before RoPE on a layer whose rotation ``restkv.scoring.rope``
    cannot undo (``layer_rotary`` gave None), as a ``ConfigError`` (the config and the model do not go
    together): when the config meets the model (``probe_rotations``), or at the prefill of a family
    patched without a model."""
    readers = [flag for part in config.parts for flag in part.pre_rope_flags()]
    if readers:
        raise ConfigError(f"{', '.join(readers)} read{'s' if len(readers) == 1 else ''} keys before RoPE; "
                         f"{_rotation_not_undone(module)}")


def _rotation_not_undone(module: torch.nn.Module) -> str:
    return (f"{module.config.model_type} layer {module.layer_idx} rotates them in a way restkv does not undo "
            "(interleaved channel pairs, part of the channels, or tables its forward computes itself)")
