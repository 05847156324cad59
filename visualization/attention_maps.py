"""One layer's attention before and after compression, for the attention heatmap figure.

The layer's post-RoPE queries, keys and values are rebuilt from its input (captured with a
forward pre-hook on the attention module) exactly as restkv's attention forward builds them;
``restkv.compress_kv`` on them says which keys the method keeps. "Before" is the head's causal
attention over the whole prompt; "after" is the same queries attending to the kept keys only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from restkv import CompressionConfig, compress_kv
from restkv.integrations.transformers.capture import attention_inputs


@dataclass(frozen=True)
class LayerAttention:
    """``before``/``after``: ``[queries, keys]`` probabilities of one query head; ``kept``: key positions."""

    before: np.ndarray
    after: np.ndarray
    kept: list[int]
    first_query: int


def attention_module(model, layer_idx: int) -> torch.nn.Module:
    modules = [m for m in model.modules() if hasattr(m, "q_proj") and getattr(m, "layer_idx", None) == layer_idx]
    if not modules:
        layers = sum(1 for m in model.modules() if hasattr(m, "q_proj"))
        raise ValueError(f"--layer {layer_idx}: the model has attention layers 0..{layers - 1}")
    return modules[0]


@torch.no_grad()
def layer_qkv(model, input_ids: torch.Tensor, layer_idx: int):
    """(query ``[1, H, N, d]``, key, value ``[1, H_kv, N, d]``, module) of one layer for a prompt."""
    module = attention_module(model, layer_idx)
    captured = {}

    def keep_inputs(_module, args, kwargs):
        captured["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
        captured["rope"] = kwargs["position_embeddings"]

    handle = module.register_forward_pre_hook(keep_inputs, with_kwargs=True)
    try:
        model(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    query, key, value = attention_inputs(module, captured["hidden"], captured["rope"])
    return query, key, value, module


def _head_probabilities(query, key, scaling, softcap, sliding_window, allowed) -> torch.Tensor:
    """Causal softmax of one head's logits ``[N, N]`` over the keys in ``allowed`` ``[N]``."""
    length = query.shape[0]
    logits = (query.float() @ key.float().T) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    positions = torch.arange(length)
    visible = (positions[None, :] <= positions[:, None]) & allowed[None, :]
    if sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    logits = logits.masked_fill(~visible, float("-inf"))
    probabilities = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probabilities, nan=0.0)  # a query that sees no kept key attends to nothing


def layer_attention(model, input_ids: torch.Tensor, layer_idx: int, head: int, config: CompressionConfig,
                    last_queries: int | None = None) -> LayerAttention:
    """Query head ``head``'s attention in layer ``layer_idx``, with the full and the compressed cache."""
    query, key, value, module = layer_qkv(model, input_ids, layer_idx)
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if not 0 <= head < num_heads:
        raise ValueError(f"--head {head}: layer {layer_idx} has query heads 0..{num_heads - 1}")
    sliding_window = getattr(module, "sliding_window", None)
    softcap = getattr(module, "attn_logit_softcapping", None)
    compressed = compress_kv(
        query, key, value, config, layer_idx=layer_idx, num_layers=model.config.num_hidden_layers,
        o_proj_weight=module.o_proj.weight, scaling=module.scaling, softcap=softcap, sliding_window=sliding_window,
    )
    kv_head = head // (num_heads // num_kv_heads)
    kept = sorted(int(i) for i in compressed.indices[0, kv_head].tolist() if i >= 0)
    length = query.shape[2]
    allowed = torch.zeros(length, dtype=torch.bool)
    allowed[kept] = True
    args = (query[0, head], key[0, kv_head], module.scaling, softcap, sliding_window)
    before = _head_probabilities(*args, torch.ones(length, dtype=torch.bool))
    after = _head_probabilities(*args, allowed)
    first = 0 if last_queries is None else max(0, length - last_queries)
    return LayerAttention(before[first:].numpy(), after[first:].numpy(), kept, first)
