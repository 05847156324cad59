"""RoPE undone: a layer's pre-rotation queries and keys from the rotated ones the cache holds.

IndexMem's memory and gate read queries and keys without their position (the paper's memory
carries none), while attention, the cache and the compression pipeline see them after RoPE. The layers
whose rotation this undoes (``restkv.integrations.transformers.rotation.layer_rotary`` probes each; a layer without RoPE
gets the identity tables) rotate as transformers' ``apply_rotary_pos_emb`` does:
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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` of ``x`` ``[B, H, n, d]`` with ``cos``, ``sin`` ``[B, n, d]`` (in float32,
    returned in ``x``'s dtype): ``unrotate``'s inverse."""
    cos, sin, plain = cos.float().unsqueeze(1), sin.float().unsqueeze(1), x.float()
    return (plain * cos + rotate_half(plain) * sin).to(x.dtype)


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


def following_rotation(cos: torch.Tensor, sin: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean ``cos`` and ``sin`` ``[d]`` of the ``count`` positions after the last of a row's
    consecutive positions, whose ``cos``/``sin`` ``[n, d]`` (n >= 2) a forward used: every
    rotation transformers' families apply turns each channel by a fixed angle per position
    (default, linear, Llama 3 and YaRN scaling alike), read here from the row's own angles (their
    mean step, in float64), so no rotary module is needed. Float64."""
    if cos.shape[0] < 2:
        raise ValueError("the rotation of later positions is read from at least 2 consecutive positions")
    cos, sin = cos.double(), sin.double()
    amplitude = (cos[-1].square() + sin[-1].square()).sqrt()  # the rope's attention scaling
    angles = torch.atan2(sin, cos)
    steps = torch.remainder(angles.diff(dim=0) + torch.pi, 2 * torch.pi) - torch.pi  # each in (-pi, pi]
    step = steps.mean(dim=0)
    ahead = angles[-1] + step * torch.arange(1, count + 1, dtype=torch.float64, device=cos.device)[:, None]
    return amplitude * ahead.cos().mean(dim=0), amplitude * ahead.sin().mean(dim=0)


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[d, d]`` the linear map ``x -> x cos + rotate_half(x) sin`` (``apply_rotary_pos_emb``)."""
    return torch.diag(cos) + sin[:, None] * rotate_half(torch.eye(cos.shape[0], dtype=cos.dtype, device=cos.device)).T
