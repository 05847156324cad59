"""Each layer's queries and keys before RoPE, read from a forward of the model itself.

Statistics of a model's attention (DuoAttention's head scores, on the fly or offline; Expected
Attention's query statistics) need the queries and keys as the attention computes them, before their
rotation: a forward pre-hook on every attention module reads its input and RoPE tables, and the
module's own forward, run to its kernel with the identity rotation
(``restkv.integrations.transformers.capture.attention_inputs`` with cos 1 and sin 0), gives them unrotated, whatever the
family's RoPE; the tables kept beside them are the ones ``restkv.scoring.rope`` turns this layer with
(``restkv.integrations.transformers.rotation.undoable_rotary``: the identity on a layer without RoPE).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch

from restkv.integrations.transformers.capture import attention_inputs
from restkv.integrations.transformers.rotation import undoable_rotary


class Projections(NamedTuple):
    """One layer's pre-RoPE ``query`` ``[H, n, d]`` and ``key`` ``[H_kv, n, d]`` (float32), and the
    ``(cos, sin)`` ``[1, n, d]`` the forward rotated them with."""

    query: torch.Tensor
    key: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]


def pre_rope_projections(model, input_ids: torch.Tensor, qk_norm: bool = True) -> list[Projections]:
    """Per layer, the pre-RoPE projections of ``input_ids`` ``[1, n]`` (one forward, no cache); with
    ``qk_norm=False``, read without the attention's ``q_norm`` and ``k_norm`` modules (the names the
    families with per-head q/k norms give them: Gemma 3, Qwen 3, OLMo 2...)."""
    decoder = model.get_decoder()
    found: dict[int, Projections] = {}

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        with contextlib.ExitStack() as norms:
            if not qk_norm:
                for name in ("q_norm", "k_norm"):
                    norms.enter_context(_replaced(module, name, torch.nn.Identity()))
            query, key, _ = attention_inputs(module, hidden, (torch.ones_like(cos), torch.zeros_like(sin)))
        rotary = undoable_rotary(module, (cos, sin), hidden, key.shape[-1])
        found[module.layer_idx] = Projections(query[0].float(), key[0].float(),
                                              (rotary[0][:1].float(), rotary[1][:1].float()))

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in decoder.layers]
    try:
        with torch.no_grad():
            decoder(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [found[index] for index in range(len(decoder.layers))]


@contextlib.contextmanager
def _replaced(module: torch.nn.Module, name: str, stand_in: torch.nn.Module) -> Iterator[None]:
    """``module.<name>`` (a submodule, where it has one) replaced by ``stand_in`` for the block."""
    original = getattr(module, name, None)
    if not isinstance(original, torch.nn.Module):
        yield
        return
    setattr(module, name, stand_in)
    try:
        yield
    finally:
        setattr(module, name, original)
