"""RoPE undone: a layer's pre-rotation queries and keys from the rotated ones the cache holds.

IndexMem's memory and gate read queries and keys without their position (NEWER_METHODS.md
§3.1), while attention, the cache and the compression pipeline see them after RoPE. Every
supported family rotates with transformers' ``apply_rotary_pos_emb``:
``x cos + rotate_half(x) sin``, a rotation of each channel pair, with ``cos`` and ``sin``
scaled by the rope's ``attention_scaling`` (1 unless YaRN-like). It is undone exactly by
``(y cos - rotate_half(y) sin) / (cos^2 + sin^2)`` with the same ``cos`` and ``sin``:

* ``unrotate(x, cos, sin)``: with the ``position_embeddings`` a forward already holds (what
  the attention forward passes to the family, ``[B, n, d]`` each);
* ``rotary_inverse(model, layer_idx)``: ``unrotate(x, positions)`` for code that has only
  positions (compression after the whole prefill), from the model's own rotary embedding
  (Gemma 3: the layer type's).
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.models.llama.modeling_llama import rotate_half

#: ``(x [B, H, n, d], positions [B, n]) -> pre-RoPE x``
Unrotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE ``x`` ``[B, H, n, d]`` that ``apply_rotary_pos_emb`` with ``cos``, ``sin``
    ``[B, n, d]`` turned into ``x`` (computed in float32, returned in ``x``'s dtype)."""
    cos, sin, rotated = cos.float().unsqueeze(1), sin.float().unsqueeze(1), x.float()
    return ((rotated * cos - rotate_half(rotated) * sin) / (cos.square() + sin.square())).to(x.dtype)


def rotary_inverse(model, layer_idx: int) -> Unrotate:
    """``unrotate(x, positions)`` for layer ``layer_idx`` of ``model`` (a ``*ForCausalLM`` or
    its decoder): ``cos``/``sin`` from the model's rotary embedding at ``positions`` ``[B, n]``
    (the position ids the forward used), then ``unrotate``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = decoder.rotary_emb
    extra = (decoder.config.layer_types[layer_idx],) if hasattr(rotary, "layer_types") else ()

    def undo(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            cos, sin = rotary(x, positions.to(x.device), *extra)
        return unrotate(x, cos, sin)

    return undo
