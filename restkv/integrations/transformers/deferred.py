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
asked, as KVzip's reference runs it: the context is cut into chunks of
``--reconstruction_chunk`` tokens, and each chunk is fed after its instruction
(``restkv.integrations.transformers.reconstruction_prompt``), at the positions right after the context. Its queries
attend to the whole uncompressed context and to the chunk's own repetition (the model's
attention, unchanged); a chunk's scores are its queries' softmax over the context's sinks (the
template before the context span, or the method's ``--n_sink`` first tokens), the context
chunk it repeats and its own repetition, restricted to the context chunk, and every layer folds
them into ``ReconstructionStats``. The repetition's K/V is dropped after each chunk. Then the
cache is as the prefill left it; a policy that asks for a step before eviction
(``Policy.steps_before_eviction``: RestoreKV's restore pass) runs it, given ``forward_after_context`` (new
embeddings run after the whole uncompressed context, their K/V returned and the cache left as it was), and
the summary segments it returns wait in their ``PendingLayer`` (``joining``): each layer's budget is
lowered by the slots they fill before it is ranked, and they join its compressed form. Then every pending
layer is scored, the allocation runs (across the model if it is model-wide), and each layer is replaced by
its compressed form.

Under ``--prefill_chunk_size`` such a run waits for each chunk instead of the whole prompt
(``restkv.integrations.transformers.attention``'s chunked prefill calls ``finish_prefill`` after every chunk). The first
chunk is deferred as above; each later one is appended to its already compressed layer and
deferred with its first column (``PendingLayer.first_column``). Its reconstruction repeats the
chunk's own tokens, their queries attending to what the layer kept of earlier chunks, the
chunk itself and the repetition; their scores read each head's sinks (its first kept tokens),
the chunk and the repetition (``observe_held_chunk``), so a chunk's tokens get the scores the
single pass gives them when nothing was evicted before (the last chunk's exactly, in a test).
Then ``restkv.pipeline.recompress.rank_chunk`` ranks the kept tokens' stored scores beside the chunk's,
to the whole prompt's budget (``chunk_budgets``). Peak cache, per layer and KV head (model-wide:
summed over them): ``budget + N + repetition``, where ``N`` is ``--prefill_chunk_size`` and ``repetition``
the instruction plus ``--reconstruction_chunk`` tokens; flat in the prompt's length.
The scores a chunk's ranking compares are fixed once read; a window observation's, which
change with every chunk's queries, are refused with chunked prefill when the allocation is
model-wide (``CompressionConfig._check_recompression``).

Memory (single pass): the peak is the uncompressed prefill's cache, plus during reconstruction one chunk's
repetition K/V (instruction + ``--reconstruction_chunk`` tokens) and one float32 block of at
most ``RECONSTRUCTION_BLOCK_ELEMENTS`` attention weights (queries x heads x scored keys; the
model's own attention of the chunk over the context comes on top, as in any forward).
Cost: one extra forward per chunk, each over its chunk against context + chunk keys, so the
whole pass costs one forward over the context with ``(L + chunk) / L`` times the keys. On the CPU
(``attend_and_observe``) that forward's attention is read as partials whose log-sum-exps are the
scores' softmax normaliser, so the scores cost one product of the queries with the chunk's keys
and one ``exp``; elsewhere the model's own kernel runs and the scores read ``sinks + 2 x chunk``
keys per query in a softmax of their own. Reconstruction runs one row at a time
(batch 1; a left-padded row repeats its real tokens).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from restkv.cache import CompressedLayer
from restkv.cache.partial import Partial, Probe, attend_block, merge
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.context_span import context_span, protected_span
from restkv.integrations.transformers.handles import cache_state
from restkv.integrations.transformers.reconstruction_prompt import NO_PROMPT, reconstruction_prompt
from restkv.integrations.transformers.replay_gradients import replay_gradient_norms
from restkv.pipeline.compress import compress_layer
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import LayerPlan
from restkv.pipeline.recompress import ScoredChunk, rank_chunk, remember_newest
from restkv.scoring.observation import ReconstructionObservation, ReconstructionStats

#: float32 attention weights (query heads x queries x scored keys) of one block of a reconstruction
#: chunk's scores: 4 MiB (a block its reductions read while it is still in cache; 16 MiB ran slower)
RECONSTRUCTION_BLOCK_ELEMENTS = 1 << 20


@dataclass
class PendingLayer:
    """A layer whose prefill is stored whole until the model's forward has finished: its ``LayerInputs`` as
    the prefill made them (``query``: the trailing prompt queries its window observation and residual proxy
    read; ``hidden`` only for a policy that scores it, ``kept_hidden``), and what the wait adds to them."""

    config: Any
    inputs: LayerInputs
    stats: ReconstructionStats | None = None
    #: None: the cache holds the layer's whole prefill (``key``, ``value``); else the layer is already
    #: compressed and ``key``/``value`` are a later prompt chunk appended to it from this padded-batch column
    first_column: int | None = None
    #: ``[1, q]`` the running reconstruction chunk's gradient norms (KVgrad), set before its scoring forward
    gradient_norms: torch.Tensor | None = None
    #: summary segments a step before eviction made for the layer (RestoreKV's restore tokens): they join the
    #: compressed layer and fill ``budget_slots()`` of each head's budget, which its eviction keeps less by
    joining: list = field(default_factory=list)

    @property
    def plan(self) -> LayerPlan:
        return self.inputs.plan

    @property
    def reconstructed(self) -> bool:
        """Whether this layer is scored by the reconstruction queries (every pending layer under
        ``--observation reconstruction``: sliding-window layers are not compressed then, as in
        KVzip's reference, a query after the context no longer seeing their older tokens)."""
        return self.config.run.observation == "reconstruction"


@dataclass(frozen=True)
class RepeatedChunk:
    """The context chunk a reconstruction forward repeats: the cache columns its scores' softmax
    covers besides the repetition itself."""

    sinks: torch.Tensor  # columns of the sinks before the chunk, always in the softmax
    start: int  # the chunk's columns [start, stop)
    stop: int
    #: the column of the layer's statistics' first one: 0 for the cache's columns, the sinks' count for
    #: a compressed layer read as sinks + appended chunk + repetition (``observe_held_chunk``)
    offset: int = 0

    def scored_columns(self, device: torch.device) -> torch.Tensor:
        """The context columns the scores' softmax covers besides the repetition: the sinks, then the chunk."""
        return torch.cat([self.sinks, torch.arange(self.start, self.stop)]).to(device)


@dataclass
class PendingPrefill:
    """The layers of one prefill waiting for compression (attached to the cache)."""

    context_ids: torch.Tensor | None = None
    layers: dict[int, PendingLayer] = field(default_factory=dict)
    repeating: RepeatedChunk | None = None
    #: whether the running chunk's attention is folded into the statistics (not during KVgrad's gradient pass)
    folding: bool = True

    @property
    def observing(self) -> bool:
        """Whether a reconstruction chunk is running (its forward must leave the pending layers alone)."""
        return self.repeating is not None


def pending_of(cache) -> PendingPrefill | None:
    return cache_state(cache).pending if cache is not None else None


def defer_layer(cache, layer_idx: int, pending_layer: PendingLayer) -> None:
    """Leave ``pending_layer`` for ``finish_prefill`` (the cache already holds its full K/V)."""
    pending = pending_of(cache)
    if pending is None:
        pending = PendingPrefill()
        cache_state(cache).pending = pending
    pending.layers[layer_idx] = pending_layer


def kept_hidden(config, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The attention's input a deferred layer keeps: only for a policy that scores it (KVzap)."""
    return hidden_states if config.policy.needs_hidden_states else None


def trailing_queries(config, query: torch.Tensor) -> torch.Tensor:
    """The prompt queries a deferred layer keeps: its observation window, and the residual
    proxy's observation queries when the residual cache is on."""
    residual = config.switch("residual")
    count = max(config.run.window_size, residual.residual_obs_queries if residual is not None else 0, 1)
    return query[:, :, max(query.shape[2] - count, 0) :]


def observe_chunk(pending_layer: PendingLayer, chunk: RepeatedChunk, query: torch.Tensor, key: torch.Tensor,
                  weights_of_queries: torch.Tensor | None = None) -> None:
    """Fold a reconstruction chunk's queries ``[1, H, q, d]`` into the layer's statistics; ``key``
    ``[1, H_kv, T, d]`` holds the context and, last, the chunk's ``q`` repeated tokens (the cache's
    keys). Each block of queries reads the sinks, the context chunk and the repetition up to
    itself (causal), in blocks of at most ``RECONSTRUCTION_BLOCK_ELEMENTS`` weights.
    ``weights_of_queries`` ``[1, q]``: each query's attention is multiplied by it (``query_weights``)."""
    repeated = query.shape[2]
    columns = chunk.scored_columns(key.device)
    scored = torch.cat([key.index_select(2, columns), key[:, :, key.shape[2] - repeated :]], dim=2)
    sinks, context = chunk.sinks.numel(), columns.numel()
    block = max(1, RECONSTRUCTION_BLOCK_ELEMENTS // (query.shape[1] * scored.shape[2]))
    for start in range(0, repeated, block):
        stop = min(start + block, repeated)
        weights = chunk_attention(query[:, :, start:stop], scored[:, :, : context + stop],
                                  pending_layer.inputs.scaling, pending_layer.inputs.softcap)
        if weights_of_queries is not None:
            weights = weights * weights_of_queries[:, None, start:stop, None]
        pending_layer.stats.add(weights[..., sinks:context], chunk.start - chunk.offset, query[:, :, start:stop])


def attend_and_observe(pending_layer: PendingLayer, chunk: RepeatedChunk, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, facts,
                       weights_of_queries: torch.Tensor | None = None) -> torch.Tensor | None:
    """A reconstruction chunk's attention ``[1, q, H, d]`` computed so that its scores cost no second pass over
    the repetition: the model's attention read as three partials merged by log-sum-exp (the scored context
    columns, sinks + chunk, with the CPU's fused kernel; the other context columns; the repetition, causal), and
    the scores' softmax normaliser is the first and last partials' log-sum-exp, so each block of scores is one
    product with the chunk's keys and one ``exp`` (``observe_chunk`` computes the same weights from a softmax
    of its own over sinks + chunk + repetition). None where this does not apply (a padded or sliding-window
    context, soft-capped logits, a device without a fused kernel that returns the log-sum-exp): then the
    model's own kernel runs and ``observe_chunk`` scores."""
    repeated, total = query.shape[2], key.shape[2]
    context = total - repeated
    if query.shape[0] != 1 or key.device.type != "cpu" or facts.softcap is not None or \
            (facts.sliding_window is not None and facts.sliding_window < total) or \
            not bool(pending_layer.plan.valid[0, :context].all()) or query.shape[-1] != value.shape[-1]:
        return None
    kv_heads = key.shape[1]
    probe = Probe(query, kv_heads, context, facts.scaling, need_lse=True)
    scored = chunk.scored_columns(key.device)
    others = torch.ones(context, dtype=torch.bool, device=key.device).index_fill_(0, scored, False).nonzero()[:, 0]
    inside = attend_block(probe, key.index_select(2, scored), value.index_select(2, scored), None)
    groups = query.shape[1] // kv_heads
    repetition_keys, repetition_values = (t[:, :, context:].repeat_interleave(groups, dim=1) for t in (key, value))
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, repetition_keys, repetition_values, 0.0, True, scale=facts.scaling)[:2]
    repetition = Partial(output.reshape(probe.stacked.shape), lse.float().reshape(probe.stacked.shape[:-1]))
    parts = [inside, repetition]
    if others.numel():
        parts.append(attend_block(probe, key.index_select(2, others), value.index_select(2, others), None))
    normaliser = torch.logaddexp(inside.lse, repetition.lse).reshape(kv_heads * groups, repeated)  # [H, q]
    chunk_keys = key[0, :, chunk.start : chunk.stop].float().transpose(-1, -2)  # [H_kv, d, c]
    width = chunk_keys.shape[-1]
    block = max(1, RECONSTRUCTION_BLOCK_ELEMENTS // (query.shape[1] * width))
    for start in range(0, repeated, block):
        stop = min(start + block, repeated)
        rows = (query[0, :, start:stop].float() * facts.scaling).reshape(kv_heads, groups * (stop - start), -1)
        weights = torch.bmm(rows, chunk_keys).view(1, -1, stop - start, width)
        weights = weights.sub_(normaliser[None, :, start:stop, None]).exp_()
        if weights_of_queries is not None:
            weights = weights * weights_of_queries[:, None, start:stop, None]
        pending_layer.stats.add(weights, chunk.start - chunk.offset, query[:, :, start:stop])
    return probe.interface(merge(parts, statistics=False).output).to(query.dtype)


def observe_held_chunk(pending_layer: PendingLayer, chunk: RepeatedChunk, query: torch.Tensor, layer,
                       weights_of_queries: torch.Tensor | None = None) -> None:
    """``observe_chunk`` for a compressed layer holding a chunked prompt: its keys read as its
    sinks (each head's first kept tokens), then what was appended since its last compression (the
    prompt chunk and the repetition)."""
    sinks = chunk.sinks.numel()
    keys, _, columns = layer.kept_tokens()
    expected = torch.arange(sinks, dtype=columns.dtype, device=columns.device) + layer.prompt_padding.to(columns)
    if columns.shape[2] < sinks or not bool((columns[:, :, :sinks] == expected).all()):
        raise RuntimeError(f"layer {pending_layer.plan.layer_idx} no longer holds its {sinks} sinks")
    appended = layer.tail.appended_tokens()[0]
    observe_chunk(pending_layer, chunk, query, torch.cat([keys[:, :, :sinks], appended], dim=2), weights_of_queries)


def query_weights(pending_layer: PendingLayer, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """``[1, q]`` what each of a reconstruction chunk's queries' attention is multiplied by, when the
    layer's policy weights them: ``1 / ||h||`` of its hidden state (KVzip+) or its gradient norm
    (KVgrad, ``restkv.integrations.transformers.replay_gradients``); else None."""
    policy = pending_layer.config.policy
    if policy.divides_by_hidden_norm:
        return 1.0 / hidden_states.float().norm(dim=-1)
    if policy.weights_by_gradient:
        if pending_layer.gradient_norms is None:
            raise RuntimeError(f"layer {pending_layer.plan.layer_idx}: the chunk's gradient norms were not computed")
        return pending_layer.gradient_norms
    return None


def chunk_attention(query: torch.Tensor, key: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """``[1, H, q, K]`` float32 softmax of a block of a chunk's repeated queries over ``key``
    ``[1, H_kv, K, d]``: the scored context columns, then the repetition up to the block's newest
    query (each query sees the repetition up to itself: only the block's own corner is masked)."""
    _, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.float().reshape(kv_heads, groups * rows, dim)
    k = key[0].float().transpose(-1, -2)
    logits = torch.baddbmm(q.new_empty(()), q, k, beta=0.0, alpha=scaling).view(1, heads, rows, length)
    if softcap is not None:
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    corner = logits[..., length - rows :]  # the block's own repeated keys: causal among themselves
    future = torch.ones(rows, rows, dtype=torch.bool, device=key.device).triu_(1)
    corner.masked_fill_(future, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=-1)


def finish_prefill(model_forward: Callable, model, cache) -> None:
    """Compress every pending layer of ``cache`` (see the module docstring). ``model_forward``
    is the decoder model's unpatched forward, run for the reconstruction chunks."""
    pending = pending_of(cache)
    if pending is None or pending.observing:
        return
    try:
        if any(layer.reconstructed for layer in pending.layers.values()):
            _reconstruct(model_forward, model, cache, pending)
        _before_eviction(model_forward, model, cache, pending)
        _compress_pending(cache, pending)
    finally:
        cache_state(cache).pending = None


def _before_eviction(model_forward: Callable, model, cache, pending: PendingPrefill) -> None:
    """The step a policy asks for between its scoring and the eviction (``Policy.steps_before_eviction``: RestoreKV's
    restore pass): given the decoder, its pending layers and ``forward_after_context``, it returns the summary
    segments each layer joins (``PendingLayer.joining``)."""
    for config in dict.fromkeys(layer.config for layer in pending.layers.values()):
        if not config.policy.steps_before_eviction:
            continue
        layers = {index: layer for index, layer in pending.layers.items() if layer.config == config}
        forward = functools.partial(forward_after_context, model_forward, model, cache, pending)
        for index, segments in config.policy.before_eviction(model, sorted(layers), forward).items():
            layers[index].joining = list(segments)


def forward_after_context(model_forward: Callable, model, cache, pending: PendingPrefill,
                          embeddings: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run ``embeddings`` ``[1, n, D]`` through the decoder right after the context (positions following its
    real tokens, attending to the whole uncompressed context and causally to each other, the model's own
    attention) and return each pending layer's ``(key, value)`` ``[1, H_kv, n, d]`` of them; the cache is
    left as the prefill left it."""
    context = pending.context_ids
    if context is None or context.shape[0] != 1:
        raise ValueError("a step before eviction runs after one prompt at a time (batch size 1, input_ids)")
    padding = int(next(iter(pending.layers.values())).plan.padding[0])
    count = embeddings.shape[1]
    saved = [copy.copy(layer) for layer in cache.layers]
    try:
        with torch.no_grad():
            model_forward(model, inputs_embeds=embeddings, use_cache=True, **_after_context(context, padding, count),
                          **with_cache(cache))
        return {index: (cache.layers[index].keys[:, :, -count:], cache.layers[index].values[:, :, -count:])
                for index in pending.layers}
    finally:
        cache.layers[:] = saved


def _reconstruct(model_forward: Callable, model, cache, pending: PendingPrefill) -> None:
    context = pending.context_ids
    if context is None or context.shape[0] != 1:
        raise ValueError("--observation reconstruction compresses one prompt at a time (batch size 1, input_ids)")
    index, waiting = next((i, layer) for i, layer in pending.layers.items() if layer.reconstructed)
    config, held = waiting.config, waiting.first_column is not None
    # A left-padded row repeats its real tokens only, at the positions that follow them, and
    # no reconstruction query sees its padding.
    padding = int(cache.layers[index].prompt_padding[0] if held else waiting.plan.padding[0])
    real = context.shape[1] - padding
    first = max((waiting.first_column or 0) - padding, 0)  # the first token these layers wait on (row-local)
    start, stop = context_span(cache) or (0, real)  # the context alone, not its template
    sink_end = max(start, getattr(config.policy, "n_sink", 0))
    size = config.run.reconstruction_chunk or max(stop - start, 1)  # None: the whole context at once
    pieces = [(piece, min(piece + size, stop, real)) for piece in range(max(start, first), min(stop, real), size)]
    prompt = reconstruction_prompt(model) if config.policy.repeats_with_instruction else NO_PROMPT
    tokens = context[0, padding:]
    form = config.run.reconstruction_prompt
    inputs = [torch.cat([prompt.before(tokens[max(start, piece - size) : piece] if piece > start else None, form).to(
        context.device), tokens[piece:last]]) for piece, last in pieces]
    expected = sum(ids.shape[0] for ids in inputs)
    for layer in pending.layers.values():
        if layer.reconstructed:
            layer.stats = _stats_for(layer, expected)
    if not pieces:  # a chunk of template alone: every token of it is protected
        return
    saved = [copy.copy(layer) for layer in cache.layers]
    try:
        with torch.no_grad():
            for (piece, last), ids in zip(pieces, inputs):
                pending.repeating = _repeated(piece, last, padding, min(sink_end, piece), waiting.first_column)
                forward = dict(use_cache=True, **_after_context(context, padding, ids.shape[0]), **with_cache(cache))
                if config.policy.weights_by_gradient:
                    _set_gradient_norms(model_forward, model, cache, pending, ids[None], forward, saved)
                model_forward(model, input_ids=ids[None], **forward)
                cache.layers[:] = [copy.copy(layer) for layer in saved]  # the repetition's K/V is dropped
    finally:
        pending.repeating = None
        cache.layers[:] = saved


def _after_context(context: torch.Tensor, padding: int, count: int) -> dict[str, torch.Tensor]:
    """The ``position_ids`` and ``attention_mask`` of ``count`` tokens run right after a context of ids
    ``[1, N]`` left-padded by ``padding``: positions following its real tokens, its padding unseen."""
    real = context.shape[1] - padding
    seen = torch.arange(context.shape[1] + count, device=context.device) >= padding
    return dict(position_ids=torch.arange(real, real + count, device=context.device)[None],
                attention_mask=seen.long()[None])


def _set_gradient_norms(model_forward: Callable, model, cache, pending: PendingPrefill, ids: torch.Tensor,
                        forward: dict, saved: list) -> None:
    """KVgrad: run the chunk ``ids`` once with autograd (nothing folded) and give each reconstructed
    layer its queries' gradient norms; the cache is left as it was."""
    pending.folding = False
    try:
        norms = replay_gradient_norms(model_forward, model, ids, **forward)
    finally:
        pending.folding = True
        cache.layers[:] = [copy.copy(layer) for layer in saved]
    for index, layer in pending.layers.items():
        if layer.reconstructed:
            layer.gradient_norms = norms[index]


def _repeated(piece: int, last: int, padding: int, sinks: int, first_column: int | None) -> RepeatedChunk:
    """The columns a reconstruction piece (row-local ``[piece, last)``) is scored over: the cache's,
    or for a compressed layer (its chunk appended from ``first_column``) sinks + chunk + repetition."""
    if first_column is None:
        return RepeatedChunk(torch.arange(padding, padding + sinks), padding + piece, padding + last)
    shift = sinks - first_column + padding
    return RepeatedChunk(torch.arange(sinks), piece + shift, last + shift, offset=sinks)


def _stats_for(layer: PendingLayer, expected: int) -> ReconstructionStats:
    """Empty statistics for ``expected`` reconstruction queries; ReST-KV's drift statistic is
    gathered only for a policy whose pooling reads it, the validation sample only with ResKV."""
    plan = layer.plan
    top = [0] * len(plan.budgets)
    if layer.config.policy.reads_attention_drift:
        top = [max(int(b) - int(p), 0) for b, p in zip(plan.budgets.tolist(), plan.protected.sum(-1).tolist())]
    residual = layer.config.switch("residual")
    samples = residual.residual_obs_queries if residual is not None else 0
    sample_at = torch.linspace(0, expected - 1, steps=min(samples, expected)).round().long()
    return ReconstructionStats(expected, plan.valid.shape[-1], top, sample_at.unique())


def _compress_pending(cache, pending: PendingPrefill) -> None:
    contexts = {index: _scoring_inputs(cache, index, layer) for index, layer in pending.layers.items()}
    by_config: dict[Any, list[int]] = {}
    for index, layer in pending.layers.items():
        by_config.setdefault(layer.config, []).append(index)
    for config, indices in by_config.items():
        scores = {index: config.policy.score(contexts[index]) for index in indices}
        for listener in _SCORE_LISTENERS:
            for index in indices:
                listener(contexts[index], scores[index])
        held = [index for index in indices if pending.layers[index].first_column is not None]
        if held:
            _rank_chunk(cache, config, {index: pending.layers[index] for index in held}, contexts, scores)
            continue
        keeps = (config.allocator.allocate_model({i: contexts[i] for i in indices}, scores)
                 if config.allocator.model_wide else {})
        for index in indices:
            layer, ctx = pending.layers[index], contexts[index]
            state = compress_layer(config, ctx, scores=scores[index], keep=keeps.get(index))
            state.summaries.extend(layer.joining)
            compressed = CompressedLayer.from_state(state, layer.plan.valid.shape[-1], layer.plan.sliding_window,
                                                    config, layer.plan.padding, cache_state(cache).expected_appends)
            if config.compresses_again:  # what its next compression scores with
                query = layer.inputs.query
                rotary = layer.inputs.rotary
                remember_newest(compressed, config, query,
                                None if rotary is None else tuple(t[:, t.shape[1] - query.shape[2]:] for t in rotary))
            if config.rescores:  # a chunked prefill: the next chunk's ranking reads the kept tokens' scores
                lasting = _outside_span(cache, layer, layer.plan.padding)  # not the window: it competes later
                marked = scores[index].float().masked_fill(lasting[:, None], float("inf"))
                compressed.token_scores = marked.gather(2, compressed.kept_columns.long().clamp(min=0))
            cache.layers[index] = compressed


def _rank_chunk(cache, config, layers: dict[int, PendingLayer], contexts: dict[int, LayerInputs],
                scores: dict[int, torch.Tensor]) -> None:
    """Rank the chunk each compressed layer of ``layers`` was appended beside what it kept, to the
    whole prompt's budget (``restkv.pipeline.recompress.rank_chunk``)."""
    chunks = {}
    for index, layer in layers.items():
        compressed = cache.layers[index]
        chunks[index] = ScoredChunk(compressed, scores[index], _outside_span(cache, layer, compressed.prompt_padding),
                                    layer.inputs.query, layer.inputs.facts)
    num_layers = next(iter(layers.values())).plan.num_layers
    rank_chunk(config, chunks, chunk_budgets(config, chunked_prompt(cache)), num_layers)


def _outside_span(cache, layer: PendingLayer, padding: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` the layer's pending tokens outside the context span (the template around it,
    protected whatever follows, ``protected_span``); ``padding`` ``[B]``: each row's."""
    valid = layer.plan.valid
    span = protected_span(layer.config, context_span(cache))
    if span is None:
        return torch.zeros_like(valid)
    columns = (layer.first_column or 0) + torch.arange(valid.shape[-1], device=valid.device)
    local = columns[None] - padding.to(valid.device)[:, None]
    return valid & ((local < span[0]) | (local >= span[1]))


def chunk_budgets(config, rows: list[int]) -> list[int]:
    """Each row's budget at the end of every chunk of a prompt read in chunks, its rows holding ``rows`` real
    tokens (``chunked_prompt``): the whole prompt's (a ratio counts every token of the row's prompt, known
    before its first chunk, so early chunks are not squeezed to a ratio of the tokens they have seen). A row
    whose budget the method cannot compress to is refused as a single pass refuses it."""
    policy, window = config.policy, config.run.window_size
    budgets = []
    for total in rows:
        budget = config.budget_for(total)
        if budget < total:
            policy.check_row(config, total, budget, policy.protected_count(window, budget))
        budgets.append(budget)
    return budgets


def chunked_prompt(cache) -> list[int] | None:
    """Each row's real tokens in the prompt the cache is reading in chunks (``--prefill_chunk_size``),
    None outside a chunked prefill."""
    return cache_state(cache).chunked_prompt if cache is not None else None


#: callbacks ``(ctx, scores)`` told every deferred layer's scores (``listening_to_scores``)
_SCORE_LISTENERS: list[Callable[[LayerInputs, torch.Tensor], None]] = []


@contextlib.contextmanager
def listening_to_scores(listener: Callable[[LayerInputs, torch.Tensor], None]) -> Iterator[None]:
    """Within the block, ``listener(ctx, scores)`` receives each deferred layer's scoring context
    and ``[B, H_kv, N]`` scores before it is compressed (``restkv.tools.train_scorer`` reads KVzip's)."""
    _SCORE_LISTENERS.append(listener)
    try:
        yield
    finally:
        _SCORE_LISTENERS.remove(listener)


def _scoring_inputs(cache, index: int, layer: PendingLayer) -> LayerInputs:
    """The layer's inputs as its prefill made them, read through what the wait gathered: the reconstruction
    queries' statistics, and for a chunk its tokens' columns and its rows' padding."""
    observation = (ReconstructionObservation(layer.stats, layer.config.run.reconstruction_reduce)
                   if layer.reconstructed else None)
    positions = padding = None
    if layer.first_column is not None:  # a chunk: its tokens' columns, and its rows' padding
        key = layer.inputs.key
        batch, num_kv_heads, length = key.shape[:3]
        positions = (layer.first_column + torch.arange(length, device=key.device)).expand(batch, num_kv_heads, -1)
        padding = cache.layers[index].prompt_padding
    plan = layer.plan
    if layer.joining:  # what a step before eviction made fills slots of each head's budget: the eviction keeps less
        slots = sum(segment.budget_slots() for segment in layer.joining).amax(dim=-1).to(plan.budgets)
        plan = dataclasses.replace(plan, budgets=plan.budgets - slots)
    return dataclasses.replace(layer.inputs, plan=plan, observation=observation, positions=positions,
                               prompt_padding=padding)
