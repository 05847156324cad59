"""The one attention forward shared by Llama, Mistral, Qwen2, Gemma, Gemma2 and Gemma3.

``restkv_attention_forward`` replaces ``<Family>Attention.forward``. It projects q/k/v
with the module's own layers (Qwen2's biases come with them), applies Gemma3's q/k norms
when the module has them, RoPE with the family's own ``apply_rotary_pos_emb``, and then:

* **Compressing prefill** (first forward into an empty cache layer, when a row holds more
  tokens than its budget): the layer output comes from the model's own attention
  implementation (eager, sdpa, flash_attention_2) over the full prompt, exactly as
  unpatched; then ``restkv.compress_kv`` selects what to keep and a ``CompressedLayer``
  replaces the cache layer.
* **Attention over the compressed segments** (decode steps, or a question chunk fed after a
  context-only compression): kept tokens, residual entries and the tail of newer tokens
  share one softmax (``attend_segments``). Nothing is compressed again.
* **Native path** otherwise (no cache, a budget at or above the prompt length, ``fullkv``,
  layers a method skips): the cache is updated and attention runs exactly as unpatched.

Gemma's scaling (``query_pre_attn_scalar``) and Gemma2's logit soft-capping are read from
the module. Sliding-window layers (Gemma2/3, Mistral with ``sliding_window``) already hold
at most ``sliding_window - 1`` prompt tokens, so they stay uncompressed unless the budget
is smaller than that; when compressed, only tokens inside the window compete, and kept
tokens leave the window as generation proceeds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from restkv.cache import CompressedLayer, native_layer
from restkv.compress import compress_kv, needs_compression, valid_from_mask
from restkv.config import CompressionConfig
from restkv.residual import ResidualReadout, capped


@dataclass(frozen=True)
class LayerParams:
    """The attention parameters of one layer, read from the module (family extras included)."""

    scaling: float
    softcap: float | None
    sliding_window: int | None

    @classmethod
    def of(cls, module: torch.nn.Module) -> "LayerParams":
        if hasattr(module, "sliding_window"):
            window = module.sliding_window
        else:  # Mistral applies config.sliding_window to every layer
            window = getattr(module.config, "sliding_window", None)
        return cls(module.scaling, getattr(module, "attn_logit_softcapping", None), window)

    def attention_kwargs(self, module: torch.nn.Module) -> dict:
        """The extra arguments this family passes to its attention interface."""
        kwargs = {}
        if hasattr(module, "sliding_window") or getattr(module.config, "sliding_window", None) is not None:
            kwargs["sliding_window"] = self.sliding_window
        if hasattr(module, "attn_logit_softcapping") and self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs


@dataclass
class Segment:
    """One block of keys/values inside the shared softmax.

    keys, values: ``[B, H_kv, S, d]``. visible: bool, broadcastable to ``[B, H_kv, 1, q, S]``
    (given as ``[B, H_kv | 1, q | 1, S]``). log_counts: optional float32 broadcastable to
    ``[B, H_kv, G, q, S]`` (given as ``[B, H_kv, 1, 1, S]``): a finite value marks the slot as a
    ResKV residual entry with that log member count, ``-inf`` an exact token.
    """

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor
    log_counts: torch.Tensor | None = None


#: how residual entries are read when the caller gives no readout: ``beta log c`` with beta = 1,
#: no gate, one softmax
PLAIN_READOUT = ResidualReadout(gate=False)


def attend_segments(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    softcap: float | None = None,
    readout: ResidualReadout | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[B, H, q, d]`` over several segments with ONE softmax.

    K/V stay at ``H_kv`` heads: the ``G`` query heads of a group are stacked instead of
    repeating keys. Logits are computed in the model dtype and normalised in float32, as
    transformers' eager attention does. Residual entries (segments with ``log_counts``) get
    ``beta log c + log g(q)`` per query head, the gate computed from the same logits of the
    exact entries (``readout``, default ``PLAIN_READOUT``). Returns ``[B, q, H, d]`` (the
    interface layout).
    """
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads = segments[0].keys.shape[1]
    groups = num_heads // num_kv_heads
    stacked = query.reshape(batch, num_kv_heads, groups * q_len, head_dim)
    logits = []
    for segment in segments:
        raw = torch.matmul(stacked, segment.keys.transpose(-1, -2)) * scaling
        logits.append(capped(raw.float().view(batch, num_kv_heads, groups, q_len, -1), softcap))
    weights = (readout or PLAIN_READOUT).weights(
        logits, [segment.visible.unsqueeze(2) for segment in segments], [segment.log_counts for segment in segments]
    )
    weights = weights.to(query.dtype).view(batch, num_kv_heads, groups * q_len, -1)
    output = None
    start = 0
    for segment in segments:
        width = segment.keys.shape[-2]
        part = torch.matmul(weights[..., start : start + width], segment.values)
        output = part if output is None else output + part
        start += width
    return output.view(batch, num_heads, q_len, head_dim).transpose(1, 2)


def project_qkv(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """Post-RoPE ``query [B, H, N, d]`` and ``key``, ``value [B, H_kv, N, d]`` of an attention module,
    with the family's extras (Gemma 3 q/k norms) and its own ``apply_rotary_pos_emb``."""
    family = sys.modules[type(module).__module__]
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if hasattr(module, "q_norm"):
        query, key = module.q_norm(query), module.k_norm(key)
    query, key = family.apply_rotary_pos_emb(query, key, *position_embeddings)
    return query, key, value


def restkv_attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Cache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in ``forward`` for the attention modules of every supported family."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    family = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    query, key, value = project_qkv(self, hidden_states, position_embeddings)

    params = LayerParams.of(self)
    config: CompressionConfig = self._restkv_config
    layer = _cache_layer(cache, self.layer_idx)
    weights = None
    if isinstance(layer, CompressedLayer) and layer.tokens_seen > 0:
        output = _attend_compressed(layer, query, key, value, attention_mask, params)
    elif (valid := _prompt_to_compress(self, config, cache, layer, query, attention_mask, params)) is not None:
        output, weights = _native_attention(self, family, query, key, value, attention_mask, params, kwargs)
        cache.layers[self.layer_idx] = _compressed_layer(self, config, query, key, value, valid, params)
    else:
        if isinstance(layer, CompressedLayer):  # a reset compressed layer serving a prompt it need not compress
            cache.layers[self.layer_idx] = native_layer(params.sliding_window)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        output, weights = _native_attention(self, family, query, key, value, attention_mask, params, kwargs)
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights


# ---------------------------------------------------------------- prefill
COMPRESSIBLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, CompressedLayer)


def _prompt_to_compress(module, config, cache, layer, query, attention_mask, params) -> torch.Tensor | None:
    """The prompt's ``[B, N]`` real-token mask if this forward is a prefill to compress, else None."""
    if layer is None or layer.get_seq_length() > 0:
        return None
    if not module.is_causal:
        raise ValueError("restkv compresses causal attention only; this model uses bidirectional attention")
    valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device)
    if not needs_compression(config, valid, module.layer_idx, params.sliding_window):
        return None
    if not isinstance(layer, COMPRESSIBLE_LAYERS) or getattr(cache, "offloading", False):
        raise ValueError(
            f"restkv compresses dynamic caches; layer {module.layer_idx} is a {type(layer).__name__}"
            f"{' (offloaded)' if getattr(cache, 'offloading', False) else ''}. Use the default cache "
            "(no cache_implementation, no offloading)"
        )
    return valid


def _compressed_layer(module, config, query, key, value, valid, params) -> CompressedLayer:
    length = query.shape[2]
    kept = compress_kv(
        query,
        key,
        value,
        config,
        layer_idx=module.layer_idx,
        num_layers=module.config.num_hidden_layers,
        o_proj_weight=module.o_proj.weight,
        attention_mask=valid,
        scaling=params.scaling,
        softcap=params.softcap,
        sliding_window=params.sliding_window,
    )
    padding = (length - valid.sum(dim=-1))[:, None, None]
    columns = torch.where(kept.indices >= 0, kept.indices + padding, kept.indices)
    residual = {}
    if kept.residual_log_counts is not None:
        residual["residual_log_counts"] = kept.residual_log_counts
        residual["residual_readout"] = ResidualReadout.from_config(config)
        if params.sliding_window is not None:
            first = kept.residual_positions
            residual["residual_columns"] = torch.where(first >= 0, first + padding, first)
    return CompressedLayer(
        kept.keys, kept.values, columns, tokens_seen=length, sliding_window=params.sliding_window, config=config,
        **residual
    )


def _native_attention(module, family, query, key, value, attention_mask, params, kwargs):
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        module.config._attn_implementation, family.eager_attention_forward
    )
    return interface(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=params.scaling,
        **params.attention_kwargs(module),
        **kwargs,
    )


def _cache_layer(cache: Cache | None, layer_idx: int):
    """The cache's layer ``layer_idx`` (created if the cache grows lazily); None without a cache."""
    if cache is None:
        return None
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[layer_idx]


def key_validity(attention_mask, batch: int, length: int, device) -> torch.Tensor:
    """``[B, N]`` real-token mask of a prefill from whatever mask the attention received.

    4-D masks (eager: additive float, sdpa: bool) mark key ``j`` real iff query ``j`` may see
    it (its diagonal): true for every real token under causal and sliding masks, false for
    padding. flash_attention_2 receives the 2-D padding mask itself; ``None`` means no padding.
    """
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"restkv supports the eager, sdpa and flash_attention_2 attention implementations; got a "
            f"{type(attention_mask).__name__} mask (flex_attention?)"
        )
    if attention_mask.dim() == 2:
        return valid_from_mask(attention_mask[:, -length:], batch, length, device)
    diagonal = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
    return valid_from_mask(diagonal, batch, length, device)


# ---------------------------------------------------------------- after compression
def _attend_compressed(layer: CompressedLayer, query, key, value, attention_mask, params) -> torch.Tensor:
    q_len = query.shape[2]
    query_columns = torch.arange(layer.tokens_seen, layer.tokens_seen + q_len, device=query.device)
    layer.append(key, value)
    tail_keys, tail_values = layer.tail
    kept_visible = (layer.kept_columns >= 0)[:, :, None, :]
    if params.sliding_window is not None:
        in_window = layer.kept_columns[:, :, None, :] > (query_columns[:, None] - params.sliding_window)
        kept_visible = kept_visible & in_window
    tail_visible = _tail_visibility(attention_mask, query.shape[0], q_len, layer.tail_length, query.device)
    segments = [
        _kept_segment(layer, kept_visible, query_columns, params.sliding_window),
        Segment(tail_keys, tail_values, tail_visible[:, None]),
    ]
    output = attend_segments(query, segments, params.scaling, params.softcap, layer.residual_readout)
    layer.trim_tail_to_window()
    return output


def _kept_segment(layer: CompressedLayer, kept_visible, query_columns, sliding_window) -> Segment:
    """The kept slots; with residual entries (in the last ``R`` slots) the segment carries their
    log-counts (``-inf`` on the exact slots)."""
    if layer.residual_width == 0:
        return Segment(layer.kept_keys, layer.kept_values, kept_visible)
    exact_slots = layer.kept_keys.shape[2] - layer.residual_width
    entries = torch.isfinite(layer.residual_log_counts)[:, :, None, :]
    if sliding_window is not None:  # an entry is visible while its oldest member is
        entries = entries & (layer.residual_columns[:, :, None, :] > (query_columns[:, None] - sliding_window))
    visible = kept_visible | torch.nn.functional.pad(entries, (exact_slots, 0), value=False)
    log_counts = torch.nn.functional.pad(layer.residual_log_counts, (exact_slots, 0), value=float("-inf"))
    return Segment(layer.kept_keys, layer.kept_values, visible, log_counts[:, :, None, None, :])


def _tail_visibility(attention_mask, batch: int, q_len: int, tail_length: int, device) -> torch.Tensor:
    """``[B, q, T]`` bool: which tail tokens (the current chunk included, last) each query sees.

    Read from the last ``T`` key columns of the mask the model built for this step (the
    compressed layer reports the uncompressed mask size); causal within the chunk.
    """
    old = tail_length - q_len
    causal = torch.arange(tail_length, device=device)[None, :] <= old + torch.arange(q_len, device=device)[:, None]
    if attention_mask is None:
        return causal[None].expand(batch, -1, -1)
    if attention_mask.dim() == 2:
        return causal[None] & attention_mask[:, None, -tail_length:].bool()
    block = attention_mask[:, 0, -q_len:, -tail_length:]
    if block.dtype != torch.bool:
        block = block > torch.finfo(block.dtype).min / 2
    return block & causal[None]
