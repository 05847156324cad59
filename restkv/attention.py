"""The one attention forward shared by Llama, Mistral, Qwen2, Qwen3, Granite, Gemma, Gemma2 and Gemma3.

``restkv_attention_forward`` replaces ``<Family>Attention.forward``. It projects q/k/v
with the module's own layers (Qwen2's biases come with them), applies Gemma3's q/k norms
when the module has them, RoPE with the family's own ``apply_rotary_pos_emb``, and then:

* **Compressing prefill** (first forward into an empty cache layer whose plan,
  ``restkv.context.plan_layer``, evicts something): the layer output comes from the model's
  own attention implementation (eager, sdpa, flash_attention_2) over the full prompt,
  exactly as unpatched; then ``restkv.compress.compress_layer`` selects what to keep and a
  ``CompressedLayer`` built from that selection replaces the cache layer.
* **Attention over the compressed segments** (decode steps, or a question chunk fed after a
  context-only compression): the compressed layer attends over its own segments
  (``CompressedLayer.attend``). Nothing is compressed again.
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
from restkv.compat import CACHE_ARGUMENT, output_cache, with_cache
from restkv.compress import compress_layer, prunes_keys
from restkv.context import LayerPlan, ScoringContext, plan_layer, valid_from_mask
from restkv.context_span import context_span
from restkv.deferred import (PendingLayer, chunk_budgets, chunked_prompt, defer_layer, finish_prefill, kept_hidden,
                             observe_chunk, observe_held_chunk, pending_of, query_weights, trailing_queries)
from restkv.handles import cache_state, has_class_config, module_config
from restkv.recompress import recompress


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
    input_shape = hidden_states.shape[:-1]
    query, key, value = project_qkv(self, hidden_states, position_embeddings)

    params = LayerParams.of(self)
    config = module_config(self)
    layer = _cache_layer(cache, self.layer_idx)
    pending = pending_of(cache)
    weights = None
    if isinstance(layer, CompressedLayer) and layer.tokens_seen > 0:
        in_chunks, first = chunked_prompt(cache) is not None, layer.tokens_seen
        output = layer.attend(query, key, value, attention_mask, params.scaling, params.softcap, position_embeddings,
                              prompt=in_chunks)
        if pending is not None and pending.observing:  # a reconstruction piece of a chunked prompt
            waiting = pending.layers.get(self.layer_idx)
            if waiting is not None and waiting.reconstructed and pending.folding:
                observe_held_chunk(waiting, pending.repeating, query, layer, query_weights(waiting, hidden_states))
        elif in_chunks and config.compresses_after_prefill:  # the chunk waits for the model's (restkv.deferred)
            valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, empty_rows=True)
            plan = plan_layer(config, valid, self.layer_idx, self.config.num_hidden_layers,
                              budgets=valid.sum(dim=-1).tolist())
            defer_layer(cache, self.layer_idx, PendingLayer(
                config, plan, key, value, trailing_queries(config, query), params.scaling, params.softcap,
                self.o_proj.weight, position_embeddings, first_column=first, hidden=kept_hidden(config, hidden_states),
            ))
        elif config.rescores:
            _compress_again(self, config, cache, layer, query, params)
    elif pending is not None and pending.observing:  # a reconstruction chunk (restkv.deferred)
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        output, weights = _native_attention(self, query, key, value, attention_mask, params, kwargs)
        waiting = pending.layers.get(self.layer_idx)
        if waiting is not None and waiting.reconstructed and pending.folding:
            observe_chunk(waiting, pending.repeating, query, key, query_weights(waiting, hidden_states))
    elif (plan := _plan_to_compress(self, config, cache, layer, query, attention_mask, params)) is not None:
        if config.compresses_after_prefill:  # the layer waits for the whole prefill (restkv.deferred)
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
            output, weights = _native_attention(self, query, key, value, attention_mask, params, kwargs)
            defer_layer(cache, self.layer_idx, PendingLayer(
                config, plan, key, value, trailing_queries(config, query), params.scaling, params.softcap,
                self.o_proj.weight, position_embeddings, hidden=kept_hidden(config, hidden_states),
            ))
        else:
            output, weights = _native_attention(self, query, key, value, attention_mask, params, kwargs)
            ctx = ScoringContext.of(query, key, value, plan, params.scaling, params.softcap, self.o_proj.weight,
                                    rotary=position_embeddings, hidden=hidden_states)
            cache.layers[self.layer_idx] = compressed = CompressedLayer.from_state(
                compress_layer(config, ctx), query.shape[2], params.sliding_window, config, plan.padding)
            if config.rescores:
                compressed.remember_queries(query, config.run.window_size)
    else:
        if isinstance(layer, CompressedLayer):  # a reset compressed layer serving a prompt it need not compress
            cache.layers[self.layer_idx] = native_layer(params.sliding_window)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        output, weights = _native_attention(self, query, key, value, attention_mask, params, kwargs)
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights


def model_forward(original: Callable) -> Callable:
    """The patched forward of a decoder model (``LlamaModel``...): ``original``, then the
    compression of layers that waited for the whole prefill (``restkv.deferred``)."""

    def forward(self, *args, **kwargs):
        chunk = _prefill_chunk(self, args, kwargs)
        output = original(self, *args, **kwargs) if chunk is None else _chunked_prefill(original, self, chunk, kwargs)
        cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values")) or output_cache(output)
        pending = pending_of(cache) if cache is not None else None
        if pending is not None and not pending.observing:
            pending.context_ids = kwargs.get("input_ids", args[0] if args else None)
            finish_prefill(original, self, cache)
        return output

    return forward


def _prefill_chunk(decoder, args, kwargs) -> int | None:
    """``--prefill_chunk_size`` if this forward is a prefill longer than it, else None."""
    attention = getattr(decoder.layers[0], "self_attn", None) if len(decoder.layers) else None
    if args or attention is None or not has_class_config(type(attention)):
        return None
    chunk = module_config(attention).run.prefill_chunk_size
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    if chunk is None or tokens is None or tokens.shape[1] <= chunk or kwargs.get("use_cache") is False:
        return None
    if cache is not None and cache.get_seq_length() > 0:
        return None
    return chunk


def _chunked_prefill(original: Callable, decoder, chunk: int, kwargs: dict):
    """Run the prompt through ``original`` in chunks of ``chunk`` tokens on one cache; each layer
    compresses again after every chunk (``_compress_again``). Returns the last chunk's output with
    the hidden states of every chunk joined, so ``model(ids)`` gives logits for the whole prompt
    as it does unpatched (``generate`` keeps only the last position's)."""
    from transformers import DynamicCache

    kwargs = dict(kwargs)
    name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    tokens = kwargs.pop(name)
    mask, positions = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    cache = kwargs.pop(CACHE_ARGUMENT, None) or kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else DynamicCache(config=decoder.config)
    if kwargs.get("output_attentions"):
        raise ValueError(f"--prefill_chunk_size {chunk}: output_attentions is not available under chunked prefill "
                         "(each chunk attends to a different cache); run the prompt in one piece to read them")
    rows = (mask.sum(dim=-1) if mask is not None else torch.full((tokens.shape[0],), tokens.shape[1])).tolist()
    outputs, cache_state(cache).chunked_prompt = [], rows
    try:
        for start, stop in chunk_bounds(tokens.shape[1], chunk):
            piece = {name: tokens[:, start:stop], **with_cache(cache)}
            if mask is not None:
                piece["attention_mask"] = mask[:, :stop]
            if positions is not None:
                piece["position_ids"] = positions[:, start:stop]
            outputs.append(original(decoder, **kwargs, **piece))
            pending = pending_of(cache)
            if pending is not None:  # layers that wait for every layer's scores of the chunk
                pending.context_ids = tokens[:, :stop] if name == "input_ids" else None
                finish_prefill(original, decoder, cache)
    finally:
        cache_state(cache).chunked_prompt = None
    decode_budget = module_config(decoder.layers[0].self_attn).run.decode_budget
    for layer in cache.layers:  # what ranked the chunks: only a decode budget reads the newest queries again
        if isinstance(layer, CompressedLayer):
            layer.token_scores = None
            if decode_budget is None:
                layer.recent_queries = None
    return _joined_chunks(outputs)


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` columns of a prompt's chunks, counted back from its end: the first
    chunk takes the remainder. A left-padded row's chunks then end where the same row's alone do
    (rows are right-aligned), so a batch compresses each row as it would alone."""
    first = length - (length - 1) // chunk * chunk
    return [(0, first)] + [(stop - chunk, stop) for stop in range(first + chunk, length + 1, chunk)]


def _joined_chunks(outputs: list):
    """The last chunk's model output with ``last_hidden_state`` (and ``hidden_states``, when
    asked for) joined over the chunks along the sequence."""
    output = outputs[-1]
    output.last_hidden_state = torch.cat([piece.last_hidden_state for piece in outputs], dim=1)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(torch.cat(layer, dim=1) for layer in zip(*(piece.hidden_states for piece in outputs)))
    return output



def _compress_again(module, config, cache, layer: CompressedLayer, query, params) -> None:
    """After a prefill chunk, or every ``--decode_interval`` generated tokens: evict again
    (``restkv.recompress``) with the newest queries."""
    window = config.run.window_size
    layer.remember_queries(query, window)  # the newest window's queries, across chunk boundaries
    if chunked_prompt(cache) is not None:  # a prompt's later chunk (its first was the prefill)
        budgets = chunk_budgets(config, cache)
        queries = layer.recent_queries
    elif config.run.decode_budget is not None and _due(layer, config.run.decode_budget, config.run.decode_interval):
        budgets = [config.run.decode_budget] * query.shape[0]
        queries = layer.recent_queries
    else:
        return
    if layer.sliding_window is not None:
        raise ValueError(
            f"--prefill_chunk_size and --decode_budget compress full-attention layers again; layer {module.layer_idx} "
            f"has a sliding window of {layer.sliding_window} and a budget below it (raise the budget to the window)"
        )
    recompress(layer, queries, config, budgets, params.scaling, params.softcap, module.o_proj.weight,
               module.layer_idx, module.config.num_hidden_layers)


def _due(layer: CompressedLayer, budget: int, interval: int) -> bool:
    """Decode-time compression runs every ``interval`` new tokens, or sooner if the layer would
    otherwise hold more than ``budget + interval`` entries (a prompt kept above the budget)."""
    held = int((layer.held_counts + layer.summary_slots).max())
    return layer.tail_length >= interval or held > budget + interval


# ---------------------------------------------------------------- prefill
COMPRESSIBLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, CompressedLayer)


def _plan_to_compress(module, config, cache, layer, query, attention_mask, params) -> LayerPlan | None:
    """The layer's plan if this forward is a prefill that evicts something, else None."""
    if layer is None or layer.get_seq_length() > 0:
        return None
    if not module.is_causal:
        raise ValueError("restkv compresses causal attention only; this model uses bidirectional attention")
    if params.sliding_window is not None and config.run.observation == "reconstruction":
        return None  # as KVzip's reference: only global layers are scored and pruned; a sliding layer keeps its window
    # A chunked prompt's first chunk may be all padding for a shorter row (its chunks end where the row's own do).
    in_chunks = chunked_prompt(cache) is not None
    valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, in_chunks)
    budgets, span = None, context_span(cache) if config.run.observation == "reconstruction" else None
    if in_chunks:  # a sliding-window layer keeps its window whole (the config checked the prompt's budget reaches it)
        budgets = valid.sum(dim=-1).tolist() if params.sliding_window is not None else chunk_budgets(config, cache)
    plan = plan_layer(config, valid, module.layer_idx, module.config.num_hidden_layers, params.sliding_window, budgets,
                      span)
    # A layer compressed again later (chunked prefill, decode budget) is held compressed from the start; ThinK
    # prunes the key channels of a layer that evicts nothing too, as its release does.
    owned = config.policy.compresses_layer(module.layer_idx) and (
        (config.rescores and params.sliding_window is None) or prunes_keys(config))
    if not plan.compress and not owned:
        return None
    if not isinstance(layer, COMPRESSIBLE_LAYERS) or getattr(cache, "offloading", False):
        raise ValueError(
            f"restkv compresses dynamic caches; layer {module.layer_idx} is a {type(layer).__name__}"
            f"{' (offloaded)' if getattr(cache, 'offloading', False) else ''}. Use the default cache "
            "(no cache_implementation, no offloading)"
        )
    return plan


def _native_attention(module, query, key, value, attention_mask, params, kwargs):
    family = sys.modules[type(module).__module__]
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


def key_validity(attention_mask, batch: int, length: int, device, empty_rows: bool = False) -> torch.Tensor:
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
        return valid_from_mask(attention_mask[:, -length:], batch, length, device, empty_rows)
    diagonal = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
    return valid_from_mask(diagonal, batch, length, device, empty_rows)
