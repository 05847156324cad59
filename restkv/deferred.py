"""Compression after the whole prefill: reconstruction observation and model-wide allocations.

Most runs compress each layer inside its own prefill forward. Two things need more than one
layer's forward before any layer is compressed:

* ``--observation reconstruction``: the observation queries are those of the model
  repeating the context, which exist only after the context's prefill;
* a model-wide allocation (``--method kvzip``'s one ranking across layers and heads): every
  layer's scores are needed before any layer's budget is known.

For such a run, each compressing layer's prefill stores its full K/V in the cache as usual
and leaves a ``PendingLayer`` (its plan, the trailing prompt queries its window observation
and residual proxy read, its output projection). When the decoder model's forward returns
(``finish_prefill``, called by the patched model forward), the reconstruction pass runs if
asked: the reconstruction prompt (an instruction in the model's chat format, then the
context itself) is fed in chunks of ``--reconstruction_chunk`` tokens, each chunk attending
to the full uncompressed cache and the repeated text before it; every layer folds its
chunk queries' attention to the context into ``ReconstructionStats``. Then the cache is put
back exactly as the prefill left it (nothing of the reconstruction stays), every pending
layer is scored, the allocation runs (across the model if it is model-wide), and each layer
is replaced by its compressed form.

Memory: the peak is the uncompressed prefill's cache, plus during reconstruction the
repeated text's K/V (up to the context length again) and one layer's attention of
``RECONSTRUCTION_QUERY_BLOCK`` queries over context + repetition (float32).
Cost: one extra forward over the context per chunk (``ceil(L / reconstruction_chunk)``).
Reconstruction runs one row at a time (batch 1; a left-padded row repeats its real tokens).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from restkv.cache import CompressedLayer
from restkv.compat import with_cache
from restkv.compress import compress_layer
from restkv.context import LayerPlan, ScoringContext
from restkv.context_span import context_span
from restkv.observation import ReconstructionObservation, ReconstructionStats
from restkv.reconstruction_prompt import reconstruction_prefix
from restkv.scoring import window_attention

#: reconstruction queries per block when their attention is folded into the statistics
RECONSTRUCTION_QUERY_BLOCK = 256


@dataclass
class PendingLayer:
    """A layer whose prefill is stored whole until the model's forward has finished."""

    config: Any
    plan: LayerPlan
    key: torch.Tensor
    value: torch.Tensor
    queries: torch.Tensor  # [B, H, n, d] trailing prompt queries (window observation, residual proxy)
    scaling: float
    softcap: float | None
    o_proj_weight: torch.Tensor
    stats: ReconstructionStats | None = None

    @property
    def reconstructed(self) -> bool:
        """Whether this layer is scored by the reconstruction queries (every pending layer under
        ``--observation reconstruction``: sliding-window layers are not compressed then, as in
        KVzip's reference, a query after the context no longer seeing their older tokens)."""
        return self.config.run.observation == "reconstruction"


@dataclass
class PendingPrefill:
    """The layers of one prefill waiting for compression (attached to the cache)."""

    context_ids: torch.Tensor | None = None
    layers: dict[int, PendingLayer] = field(default_factory=dict)
    observing: bool = False


def pending_of(cache) -> PendingPrefill | None:
    return getattr(cache, "_restkv_pending", None)


def defer_layer(cache, layer_idx: int, pending_layer: PendingLayer) -> None:
    """Leave ``pending_layer`` for ``finish_prefill`` (the cache already holds its full K/V)."""
    pending = pending_of(cache)
    if pending is None:
        pending = PendingPrefill()
        cache._restkv_pending = pending
    pending.layers[layer_idx] = pending_layer


def trailing_queries(config, query: torch.Tensor) -> torch.Tensor:
    """The prompt queries a deferred layer keeps: its observation window, and the residual
    proxy's observation queries when the residual cache is on."""
    residual = config.switch("residual")
    count = max(config.run.window_size, residual.residual_obs_queries if residual is not None else 0, 1)
    return query[:, :, max(query.shape[2] - count, 0) :]


def observe_chunk(pending_layer: PendingLayer, query: torch.Tensor, key: torch.Tensor) -> None:
    """Fold a reconstruction chunk's queries ``[1, H, c, d]`` into the layer's statistics; ``key``
    ``[1, H_kv, T, d]`` holds the context, the repetition so far and the chunk (the cache's keys)."""
    stats = pending_layer.stats
    length = pending_layer.plan.valid.shape[-1]
    chunk = query.shape[2]
    total = key.shape[2]
    valid = torch.ones(1, total, dtype=torch.bool, device=key.device)
    valid[:, :length] = pending_layer.plan.valid  # a left-padded context's padding is never seen
    for start in range(0, chunk, RECONSTRUCTION_QUERY_BLOCK):
        stop = min(start + RECONSTRUCTION_QUERY_BLOCK, chunk)
        end = total - chunk + stop  # keys the block's newest query sees
        weights = window_attention(query[:, :, start:stop], key[:, :, :end], valid[:, :end], stop - start,
                                   pending_layer.scaling, pending_layer.softcap)
        stats.add(weights[..., :length], query[:, :, start:stop], pending_layer.plan.valid)


def finish_prefill(model_forward: Callable, model, cache) -> None:
    """Compress every pending layer of ``cache`` (see the module docstring). ``model_forward``
    is the decoder model's unpatched forward, run for the reconstruction chunks."""
    pending = pending_of(cache)
    if pending is None or pending.observing:
        return
    try:
        if any(layer.reconstructed for layer in pending.layers.values()):
            _reconstruct(model_forward, model, cache, pending)
        _compress_pending(cache, pending)
    finally:
        del cache._restkv_pending


def _reconstruct(model_forward: Callable, model, cache, pending: PendingPrefill) -> None:
    context = pending.context_ids
    if context is None or context.shape[0] != 1:
        raise ValueError("--observation reconstruction compresses one prompt at a time (batch size 1, input_ids)")
    config, plan = next((layer.config, layer.plan) for layer in pending.layers.values() if layer.reconstructed)
    prefix = reconstruction_prefix(model).to(context.device)
    # A left-padded row repeats its real tokens only, at the positions that follow them, and
    # no reconstruction query sees its padding.
    padding = int(plan.padding[0])
    start, stop = context_span(cache) or (0, context.shape[1] - padding)  # the context alone, not its template
    repeat = torch.cat([prefix[None], context[:, padding + start : padding + stop]], dim=-1)
    real = context.shape[1] - padding
    seen_mask = torch.cat([plan.valid.long(), torch.ones_like(repeat)], dim=-1)
    chunk = config.run.reconstruction_chunk
    first = prefix.shape[0] + min(chunk, stop - start)  # the instruction joins the first chunk
    bounds = [0, first] + list(range(first + chunk, repeat.shape[1], chunk)) + [repeat.shape[1]]
    bounds = sorted(set(bounds))
    for layer in pending.layers.values():
        if layer.reconstructed:
            plan = layer.plan
            top = [max(int(b) - int(p), 0) for b, p in zip(plan.budgets.tolist(), plan.protected.sum(-1).tolist())]
            residual = layer.config.switch("residual")
            samples = residual.residual_obs_queries if residual is not None else 0
            sample_at = torch.linspace(0, repeat.shape[1] - 1, steps=min(samples, repeat.shape[1])).round().long()
            layer.stats = ReconstructionStats(repeat.shape[1], top, sample_at.unique())
    saved = [copy.copy(layer) for layer in cache.layers]
    pending.observing = True
    try:
        with torch.no_grad():
            for start, stop in zip(bounds[:-1], bounds[1:]):
                positions = torch.arange(real + start, real + stop, device=context.device)[None]
                model_forward(model, input_ids=repeat[:, start:stop], position_ids=positions, use_cache=True,
                              attention_mask=seen_mask[:, : context.shape[1] + stop], **with_cache(cache))
    finally:
        pending.observing = False
        cache.layers[:] = saved


def _compress_pending(cache, pending: PendingPrefill) -> None:
    contexts = {index: _scoring_context(layer) for index, layer in pending.layers.items()}
    by_config: dict[Any, list[int]] = {}
    for index, layer in pending.layers.items():
        by_config.setdefault(layer.config, []).append(index)
    for config, indices in by_config.items():
        allocator = config.allocator
        scores = {index: config.policy.score(contexts[index]) for index in indices}
        keeps = allocator.allocate_model({i: contexts[i] for i in indices}, scores) if allocator.model_wide else {}
        for index in indices:
            layer = pending.layers[index]
            state = compress_layer(config, contexts[index], scores=scores[index], keep=keeps.get(index))
            cache.layers[index] = CompressedLayer.from_state(state, layer.plan.valid.shape[-1],
                                                             layer.plan.sliding_window, config, layer.plan.padding)


def _scoring_context(layer: PendingLayer) -> ScoringContext:
    observation = (ReconstructionObservation(layer.stats, layer.config.run.reconstruction_reduce)
                   if layer.reconstructed else None)
    return ScoringContext.of(layer.queries, layer.key, layer.value, layer.plan, layer.scaling, layer.softcap,
                             layer.o_proj_weight, observation)
