"""Compressing one layer's prompt K/V: the one pipeline, and the tensor-level entry point.

``compress_layer(config, ctx)`` is the pipeline every compression runs (a compressing prefill,
compression after the whole prefill, and recompression under chunked prefill and decode
budgets): score → allocate → rescore → reserve → select → merge → rewrite keys → summarise →
store. It returns a ``LayerState``, the segments a ``restkv.cache.CompressedLayer`` is made of.
Parts take part by what they do, never by their name:

* a part with ``rescore`` (``Rescorer``: ``--critical``, ``--chunkkv``, ``--dms``,
  ``--chunk_press``, ``--block_press``) reweights the scores once the counts are known, and may
  change the counts;

* a part with ``reserve`` and ``summarise`` (``Summariser``: ResKV's ``--residual``, MomentKV's
  ``--moments``, IndexMem's policy) keeps a summary of the tokens it evicts: ``reserve``
  takes its token slots from the budgets (and may rescore), ``summarise`` returns its segments
  (summaries that join the softmax, output corrections applied after it) from the kept columns;
* the merge (``--merge``, or the method's own: CaM's) folds evicted tokens into the kept ones;
* a part with ``rewrite_keys`` (``KeyRewriter``: ``--rerotate_keys``) rewrites the kept keys;
* a part with ``storing`` (``TokenStorage``: ThinK's ``--think`` stores the kept keys with fewer
  channels, a ``--quant_method`` as codes) stores each head's older kept tokens its own way, its
  ``exact_recent_tokens`` newest whole in the segment that takes appended tokens.

``compress_kv`` is the notebook entry point: it builds the layer's plan itself and returns the
layer's state as padded tensors with row-local positions, exactly what the model keeps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Protocol, runtime_checkable

import torch

from restkv.cache.segments.base import CorrectionSegment, SummarySegment, TokenSegment, checked_segment
from restkv.cache.segments.dense import DenseTokens
from restkv.cache.segments.exact import exact_tokens, joined_view
from restkv.cache.segments.ragged import RaggedTokens
from restkv.cache.segments.residual_entries import ResidualEntries
from restkv.config import CompressionConfig
from restkv.config.composition import kept_at_ratio
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask
from restkv.scoring.selection import Reservation, gather_columns, rank_keys, select_columns


@runtime_checkable
class Summariser(Protocol):
    """A part that summarises what it evicts (see the module docstring)."""

    def reserve(self, ctx: LayerInputs, scores: torch.Tensor, keep: torch.Tensor, previous=()) -> Reservation: ...

    def summarise(self, ctx: LayerInputs, columns: torch.Tensor, memo: Any) -> list: ...


@runtime_checkable
class Rescorer(Protocol):
    """A part that reweights the scores once each head's count is known, and may change the count
    (CriticalKV, ChunkKV, threshold eviction, independent chunks): it returns both."""

    def rescore(self, config: CompressionConfig, ctx: LayerInputs, scores: torch.Tensor,
                keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class TokenStorage(Protocol):
    """A part that stores each head's older kept tokens its own way (a quantiser's codes, ThinK's keys with
    fewer channels): the newest ``exact_recent_tokens`` of each head stay whole in the segment that takes
    appended tokens. A new stored kind (low-rank keys, say) is one such part and the segment it makes
    (``restkv.cache.segments.base.TokenSegment``). Optional: ``prune_fitting_layers`` (store a layer that
    evicts nothing too) and ``seal_blocks()`` (``(seal, every)``: appended tokens stored as they come)."""

    def exact_recent_tokens(self, config: Any) -> int: ...

    def storing(self, ctx: LayerInputs, keys: torch.Tensor, columns: torch.Tensor) -> Callable | None:
        """How the layer's older tokens are stored, chosen from every kept key ``keys`` ``[B, H_kv, K, d]`` at
        ``columns``: ``way(keys, values, columns, inner) -> segment`` over the older tokens, ``inner`` storing
        them as the storage parts before this one would (exact tokens first); None leaves them as they are."""


@runtime_checkable
class KeyRewriter(Protocol):
    """A part that rewrites the kept keys once they are chosen (``--rerotate_keys``)."""

    def rewrite_keys(self, ctx: LayerInputs, columns: torch.Tensor, keys: torch.Tensor) -> torch.Tensor: ...


@dataclass
class LayerState:
    """The segments of one compressed layer.

    kept: exact-token segments (kept tokens), oldest first; the last one takes appended tokens
    (``restkv.cache.segments.exact``). summaries: segments that join the exact tokens' softmax (ResKV's
    entries, MomentKV's entry). corrections: what is applied to the merged output (IndexMem's
    memory).
    """

    kept: list
    summaries: list = field(default_factory=list)
    corrections: list = field(default_factory=list)
    #: turns a block of the tail's oldest tokens ``(keys, values, columns)`` into a stored
    #: segment (a quantiser's codes), or None: the tail stays exact
    seal: Callable | None = field(default=None, repr=False)
    #: the tokens ``seal`` takes at once, and the exact window the tail keeps beside them
    seal_every: int = 0


def compress_layer(config: CompressionConfig, ctx: LayerInputs, scores: torch.Tensor | None = None,
                   keep: torch.Tensor | None = None, previous=()) -> LayerState:
    """The segments one layer keeps, following its plan (``ctx.plan``).

    ``scores`` and ``keep`` (``[B, H_kv]`` kept counts) may come from a model-wide pass
    (``restkv.integrations.transformers.deferred``) or a recompression's allocation across heads; by default the policy
    scores and the allocation allocates here. ``previous``: the summary segments of the layer's
    last compression, which absorb what this one evicts (``restkv.pipeline.recompress``).
    """
    plan = ctx.plan
    if not plan.compress:  # every visible token stays
        counts = plan.visible_counts[:, None].expand(-1, ctx.num_kv_heads)
        columns = select_columns(rank_keys(torch.zeros(ctx.key.shape[:3], device=ctx.key.device), plan.visible,
                                           plan.protected), counts)
        return LayerState(store(config, ctx, gather_columns(ctx.key, columns), gather_columns(ctx.value, columns),
                                columns), **_sealing(config))
    policy = config.policy
    if scores is None:
        scores = policy.score(ctx)
    if keep is None:
        keep = config.allocator.allocate(ctx, scores)
    survivors = prefiltered(config, ctx)
    if survivors is not None:
        keep = torch.minimum(keep, survivors.sum(dim=-1).to(keep.device))
    for part in config.parts:
        if isinstance(part, Rescorer):
            scores, keep = part.rescore(config, ctx, scores, keep)
    if plan.shared_heads:  # one token set for every head: the heads' mean score, the smallest head's count
        scores = scores.mean(dim=1, keepdim=True).expand_as(scores)
        keep = keep.amin(dim=1, keepdim=True).expand_as(keep)
    memos = []
    for part in summarisers(config):
        reservation = part.reserve(ctx, scores, keep, previous)
        scores, keep = reservation.scores, reservation.keep
        memos.append((part, reservation.memo))
    ranked = rank_keys(scores, plan.visible, plan.protected, plan.layer_idx)
    if survivors is not None:  # what the prefilter evicted competes no more
        ranked = ranked.masked_fill(~survivors, float("-inf"))
    columns = select_columns(ranked, keep)
    keys, values = gather_columns(ctx.key, columns), gather_columns(ctx.value, columns)
    if config.merger is not None:
        keys, values = config.merger.merge(ctx, columns, keys, values)
    for part in config.parts:
        if isinstance(part, KeyRewriter):
            keys = part.rewrite_keys(ctx, columns, keys)
    summaries, corrections = [], []
    for part, memo in memos:
        for segment in part.summarise(ctx, columns, memo):
            if isinstance(segment, CorrectionSegment):
                corrections.append(segment)
            else:
                summaries.append(checked_segment(segment, SummarySegment, f"{config.chosen_by(part)}'s segment"))
    kept, summaries = co_locate(store(config, ctx, keys, values, columns), summaries)
    return LayerState(kept, summaries, corrections, **_sealing(config))


def prefiltered(config: CompressionConfig, ctx: LayerInputs) -> torch.Tensor | None:
    """``[B, H_kv, N]`` the tokens ``--prefilter`` keeps of a prompt (each row's protected tokens, the method's and
    the prefilter's own, first; then its best-scored; ``floor(visible * (1 - --prefilter_ratio))`` in all, per KV
    head), or None without a prefilter or when ``ctx`` holds tokens kept before (a compression during generation
    ranks with ``--method`` alone)."""
    prefilter = config.prefilter
    if prefilter is None or ctx.positions is not None:
        return None
    plan = ctx.plan
    length = plan.visible.shape[-1]
    counts = [kept_at_ratio(int(n), config.run.prefilter_ratio) for n in plan.visible_counts.tolist()]
    own = torch.tensor([length - prefilter.protected_count(config.run.window_size, count) for count in counts],
                       device=plan.visible.device)
    protected = plan.protected | (plan.visible & (torch.arange(length, device=own.device)[None] >= own[:, None]))
    counts = torch.tensor([[max(count, int(p))] for count, p in zip(counts, protected.sum(dim=-1).tolist())],
                          device=ctx.key.device).expand(-1, ctx.num_kv_heads)
    # The prefilter scores as it would alone: its own protected tokens do not compete.
    own_view = dataclasses.replace(ctx, plan=dataclasses.replace(plan, protected=protected))
    columns = select_columns(rank_keys(prefilter.score(own_view), plan.visible, protected, plan.layer_idx), counts)
    survivors = torch.zeros(ctx.key.shape[:3], dtype=torch.bool, device=ctx.key.device)
    return survivors.scatter_(2, columns.clamp(min=0).long(), columns >= 0)


def _sealing(config: CompressionConfig) -> dict:
    """``LayerState``'s ``seal`` and ``seal_every``: a storage part's blocks (a quantiser's), or none."""
    sealer = next((part for part in storages(config) if hasattr(part, "seal_blocks")), None)
    if sealer is None:
        return {}
    seal, every = sealer.seal_blocks()
    return dict(seal=seal, seal_every=every)


def prunes_fitting_layers(config: CompressionConfig) -> bool:
    """Whether a storage part of ``config`` stores a layer whose prompt fits the budget its way too (ThinK's
    release, ``--prune_fitting_layers``): such a layer is then compressed."""
    return any(getattr(part, "prune_fitting_layers", False) for part in storages(config))


def exact_tokens_only_conflicts(config: CompressionConfig) -> list[str]:
    """The flags of ``config`` that store or choose more than one exact token set per layer after one prefill
    (summaries, corrections, codes, pruned keys, merged values, later or deferred compression): what a layer
    that reads each head's values from other heads (``LayerPlan.shared_heads``) cannot hold."""
    flags = [config.chosen_by(part) for part in config.parts
             if isinstance(part, (Summariser, TokenStorage)) or part is config.merger]
    return flags + config.rescoring_flags() + (config.deferring_flags() if config.compresses_after_prefill else [])


def summarisers(config: CompressionConfig) -> list[Summariser]:
    """The parts of ``config`` that summarise what they evict, in composition order."""
    return [part for part in config.parts if isinstance(part, Summariser)]


def storages(config: CompressionConfig) -> list[TokenStorage]:
    """The parts of ``config`` that store older kept tokens their own way, in composition order."""
    return [part for part in config.parts if isinstance(part, TokenStorage)]


def store(config: CompressionConfig, ctx: LayerInputs, keys: torch.Tensor, values: torch.Tensor,
          columns: torch.Tensor) -> list:
    """The token segments of the kept ``keys``/``values`` ``[B, H_kv, K, d]`` at ``columns``
    (indices of ``ctx``'s keys, each head's in position order, unused slots last): one exact
    segment, or with storage parts (``TokenStorage``) each head's older tokens stored their way (the
    first part's way innermost, each later one wrapping it) and its newest ``exact_recent_tokens`` whole in
    the segment that takes appended tokens. The segments hold the keys' padded-batch columns
    (``ctx.positions_of``)."""
    parts = storages(config)
    recent = max((part.exact_recent_tokens(config) for part in parts), default=0)
    ways = [way for part in parts if (way := part.storing(ctx, keys, columns)) is not None]
    if not ways:  # every token whole and exact
        return [exact_tokens(keys, values, ctx.positions_of(columns))]
    held = (columns >= 0).sum(dim=-1, keepdim=True)
    first_recent = (held - recent).clamp(min=0)  # [B, H_kv, 1]: each head's first recent slot
    older = torch.arange(columns.shape[-1], device=columns.device) < first_recent
    width = int(first_recent.max()) if first_recent.numel() else 0
    if width == 0:  # every kept token is recent: all whole and exact
        return [_recent_tokens(ctx, keys, values, columns, first_recent, held, recent)]
    older_columns = torch.where(older, ctx.positions_of(columns), -1)[..., :width]
    older_keys = keys[:, :, :width].masked_fill(~older[..., :width, None], 0)
    older_values = values[:, :, :width].masked_fill(~older[..., :width, None], 0)
    build = partial(exact_tokens, capacity=0)
    for way in ways:
        build = partial(way, inner=build)
    segment = checked_segment(build(older_keys, older_values, older_columns), TokenSegment, "a storage part's segment")
    return [segment, _recent_tokens(ctx, keys, values, columns, first_recent, held, recent)]


def co_locate(kept: list, summaries: list) -> tuple[list, list]:
    """One buffer for the exact tokens and the residual entries when every head holds as many of
    both together (a uniform budget: exact tokens first, entries in the last slots, as the base
    method's slots): a decode step then reads the exact tokens with one kernel call and the
    entries from the same buffer, and nothing is padded. Otherwise unchanged."""
    if len(kept) != 1 or not isinstance(kept[0], (DenseTokens, RaggedTokens)) or len(summaries) != 1 \
            or not isinstance(summaries[0], ResidualEntries) or summaries[0].hosted:
        return kept, summaries
    entries = summaries[0]
    keys, values, columns = kept[0].padded(appended=False)
    held = (columns >= 0).sum(dim=-1) + entries.counts()
    width, slots = int(held.max()), entries.keys.shape[2]
    if not bool((held == width).all()) or width < slots:
        return kept, summaries
    grow = width - keys.shape[2]
    keys, values = (torch.nn.functional.pad(t, (0, 0, 0, grow)) if grow >= 0 else t[:, :, :width] for t in (keys, values))
    columns = torch.nn.functional.pad(columns, (0, grow), value=-1) if grow >= 0 else columns[:, :, :width]
    last = slice(width - slots, width)
    entry = torch.isfinite(entries.log_counts)[..., None]  # [B, H_kv, R, 1]
    keys[:, :, last] = torch.where(entry, entries.keys.to(keys.dtype), keys[:, :, last])
    values[:, :, last] = torch.where(entry, entries.values.to(values.dtype), values[:, :, last])
    host = DenseTokens(keys, values, columns)
    return [host], [entries.hosted_by(host, last)]


def _recent_tokens(ctx: LayerInputs, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                   first_recent: torch.Tensor, held: torch.Tensor, recent: int) -> DenseTokens:
    """The segment that holds each head's ``recent`` newest kept tokens whole (slots
    ``first_recent .. held``; a head that keeps fewer leaves holes) and takes the tokens appended later."""
    slots = first_recent + torch.arange(recent, device=columns.device)  # [B, H_kv, recent]
    real = slots < held
    slots = slots.clamp(max=max(columns.shape[-1] - 1, 0))
    take = lambda x: x.gather(2, slots[..., None].expand(-1, -1, -1, x.shape[-1])).masked_fill(~real[..., None], 0)
    recent_columns = torch.where(real, ctx.positions_of(columns).gather(2, slots), -1)
    return DenseTokens(take(keys), take(values), recent_columns)


# ---------------------------------------------------------------- the notebook entry point
@dataclass(frozen=True)
class CompressedKV:
    """One layer's compressed K/V, with positions local to each row.

    keys, values: ``[B, H_kv, S, d]``. Each head's kept prompt tokens fill its first slots in
    ascending position order; its summary entries (ResKV's residual entries, MomentKV's entry)
    fill its last slots; slots in between are unused (zeros). Quantised tokens are shown
    dequantised, pruned keys with zeros in the dropped channels: what attention reads.
    indices: ``[B, H_kv, S]`` row-local prompt positions of the kept tokens (0 = the row's
    first real token); -1 in summary and unused slots.
    residual_log_counts: ``[B, H_kv, R]`` float32, ``log c`` (member count) of the entry in
    each of the last ``R`` slots, ``-inf`` where that slot holds no entry; None when no head of
    the layer has one.
    residual_positions: ``[B, H_kv, R]`` row-local position of each entry's oldest member
    (-1 where no entry, or unknown off sliding-window layers); None likewise.
    residual_value_maps: ``[B, H_kv, M, d, d]`` query-dependent value terms of the last ``M``
    slots (MomentKV's value-key covariance: the slot's value for query ``q`` is
    ``value + scaling * map q``); None without them.
    key_channels: ``[B, H_kv, c]`` the key channels each head keeps with ``--think``; None otherwise.
    state: the ``LayerState`` itself (the segments the model holds: codes and scales of a
    quantised layer, the pruned keys, the summaries).

    Unpacks as ``keys, values, indices`` (what callers that ignore summary entries read).
    """

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    residual_log_counts: torch.Tensor | None = None
    residual_positions: torch.Tensor | None = None
    residual_value_maps: torch.Tensor | None = None
    key_channels: torch.Tensor | None = None
    state: LayerState | None = field(default=None, repr=False, compare=False)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.keys, self.values, self.indices))


def compress_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    config: CompressionConfig | Mapping[str, Any],
    layer_idx: int = 0,
    num_layers: int = 1,
    o_proj_weight: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    hidden_states: torch.Tensor | None = None,
) -> CompressedKV:
    """Compress one layer's prompt K/V with ``config``.

    Parameters
    ----------
    query: ``[B, H_q, N, d]`` post-RoPE queries of every prompt token (each policy takes
        the window it needs).
    key, value: ``[B, H_kv, N, d]``; ``H_q`` must be a multiple of ``H_kv`` (GQA: query
        head ``h`` reads KV head ``h // (H_q / H_kv)``).
    config: a ``CompressionConfig`` or a dict of its option names.
    layer_idx, num_layers: position of the layer (layer-dependent methods and budgets).
    o_proj_weight: ``[D, H_q * d]`` the layer's output projection (output-space scorers).
    attention_mask: optional ``[B, N]`` with 1 for real tokens, 0 for left padding.
    scaling: attention scale (default ``1/sqrt(d)``); softcap: logit soft-cap (Gemma 2).
    sliding_window: for sliding-window layers, keys older than the window are invisible.
    rotary: the ``(cos, sin)`` ``[B, N, d]`` the keys were rotated with, for scorers that read the
        keys before RoPE or rotate to other positions (``learned_zip``, ``expected_attention``).
    hidden_states: ``[B, N, D]`` the attention's input (after the layer's input norm), for scorers
        of hidden states (``kvzap``).

    Returns
    -------
    ``CompressedKV`` (keys, values, row-local indices, and the summary entries' log-counts,
    oldest positions and value maps). A row whose length does not exceed its budget keeps
    every real token.
    """
    config = CompressionConfig.from_any(config)
    valid = _validate_inputs(query, key, value, attention_mask)
    _validate_layer_inputs(query, o_proj_weight, scaling, softcap, sliding_window, rotary, hidden_states)
    if config.policy.needs_rotary and rotary is None:
        raise ValueError(f"--method {config.run.method} reads the RoPE tables the keys were rotated with: give "
                         "compress_kv the layer's rotary=(cos, sin)")
    if config.policy.needs_hidden_states and hidden_states is None:
        raise ValueError(f"--method {config.run.method} scores the attention's input: give compress_kv the layer's "
                         "hidden_states [B, N, D]")
    plan = plan_layer(config, valid, layer_idx, num_layers, sliding_window)
    facts = LayerFacts(scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]), softcap, sliding_window,
                       o_proj_weight)
    state = compress_layer(config, LayerInputs(query, key, value, plan, facts, rotary=rotary, hidden=hidden_states))
    return public_view(state, plan.padding)


def public_view(state: LayerState, padding: torch.Tensor) -> CompressedKV:
    """``state`` as ``CompressedKV`` (``padding`` ``[B]``: each row's left padding)."""
    keys, values, columns = joined_view(state.kept)
    channels = next((segment.channels for segment in state.kept if hasattr(segment, "channels")), None)
    shift = padding.to(columns.device)[:, None, None]

    def row_local(positions: torch.Tensor | None) -> torch.Tensor | None:
        return None if positions is None else torch.where(positions >= 0, positions - shift, -1)

    summary = next(iter(state.summaries), None)
    if summary is None:
        return CompressedKV(keys, values, row_local(columns), key_channels=channels, state=state)
    entry_keys, entry_values, log_counts, oldest, maps = summary.as_slots()
    # A head's entries take its last slots: the view is as wide as the widest head's tokens and entries.
    slots = log_counts.shape[-1]
    entries = torch.isfinite(log_counts)
    width = max(int(((columns >= 0).sum(dim=-1) + entries.sum(dim=-1)).max()), slots)
    grow = width - keys.shape[2]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, grow))
    values = torch.nn.functional.pad(values, (0, 0, 0, grow))
    columns = torch.nn.functional.pad(columns, (0, grow), value=-1)
    last = slice(width - slots, width)
    keys[:, :, last] = torch.where(entries[..., None], entry_keys.to(keys.dtype), keys[:, :, last])
    values[:, :, last] = torch.where(entries[..., None], entry_values.to(values.dtype), values[:, :, last])
    return CompressedKV(keys, values, row_local(columns), log_counts, row_local(oldest), maps, channels, state)


def _validate_layer_inputs(query, o_proj_weight, scaling, softcap, sliding_window, rotary, hidden_states) -> None:
    """``compress_kv``'s optional inputs, checked against ``query`` ``[B, H_q, N, d]`` before any scoring,
    so a wrong one is a ``ValueError`` naming it rather than a torch error inside a scorer."""
    batch, num_heads, length, head_dim = query.shape
    for name, number in (("scaling", scaling), ("softcap", softcap)):
        if number is not None and not (isinstance(number, (int, float)) and math.isfinite(number) and number > 0):
            raise ValueError(f"{name} must be a positive number; got {number!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive number of tokens (or None: full attention); "
                         f"got {sliding_window!r}")
    if o_proj_weight is not None and (o_proj_weight.dim() != 2 or o_proj_weight.shape[1] != num_heads * head_dim):
        raise ValueError(f"o_proj_weight must be [hidden, heads * head_dim] = [D, {num_heads * head_dim}]; got "
                         f"{list(o_proj_weight.shape)}")
    if rotary is not None:
        if not isinstance(rotary, (tuple, list)) or len(rotary) != 2 or not all(
                isinstance(table, torch.Tensor) for table in rotary):
            raise ValueError("rotary must be the (cos, sin) tables the keys were rotated with, two tensors "
                             f"[B, N, d]; got {type(rotary).__name__}")
        for name, table in zip(("cos", "sin"), rotary):
            if table.dim() != 3 or table.shape[0] not in (1, batch) or tuple(table.shape[1:]) != (length, head_dim):
                raise ValueError(f"rotary's {name} must be [B, N, d] = [{batch}, {length}, {head_dim}] (or B = 1); "
                                 f"got {list(table.shape)}")
    if hidden_states is not None:
        hidden = o_proj_weight.shape[0] if o_proj_weight is not None else hidden_states.shape[-1]
        if hidden_states.dim() != 3 or tuple(hidden_states.shape) != (batch, length, hidden):
            raise ValueError(f"hidden_states must be [B, N, D] = [{batch}, {length}, {hidden}]; got "
                             f"{list(hidden_states.shape)}")


def _validate_inputs(query, key, value, attention_mask) -> torch.Tensor:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D: [B, H_q, N, d], [B, H_kv, N, d], [B, H_kv, N, d]")
    batch, num_heads, length, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must have the same shape")
    if key.shape[0] != batch or key.shape[2] != length or key.shape[-1] != head_dim:
        raise ValueError(f"query {list(query.shape)} and key {list(key.shape)} must agree on B, N and d")
    if num_heads % key.shape[1] != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({key.shape[1]})")
    if length == 0:
        raise ValueError("empty prompt: there is nothing to compress (N = 0)")
    return valid_from_mask(attention_mask, batch, length, key.device)
