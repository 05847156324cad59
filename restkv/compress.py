"""Compressing one layer's prompt K/V: plan, score, allocate, select, merge, residual entries.

``compress_layer`` is the pipeline the patched attention runs on every compressing
prefill; ``compress_kv`` is the tensor-level entry point for notebooks and tests, which
builds the layer's plan itself and returns row-local positions. What a notebook gets from
``compress_kv`` is exactly what the model keeps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from restkv.config import CompressionConfig
from restkv.context import ScoringContext, plan_layer, valid_from_mask
from restkv.residual import ResidualPlan
from restkv.selection import Selection, gather_columns, rank_keys, select_columns


@dataclass(frozen=True)
class CompressedKV:
    """One layer's compressed K/V, with positions local to each row.

    keys, values: ``[B, H_kv, S, d]``. Each head's kept prompt tokens fill its first slots in
    ascending position order; with ``--residual`` its residual entries fill its last slots;
    slots in between are unused (zeros).
    indices: ``[B, H_kv, S]`` row-local prompt positions of the kept tokens (0 = the row's
    first real token); -1 in residual and unused slots.
    residual_log_counts: ``[B, H_kv, R]`` float32, ``log c`` (member count) of the entry in
    each of the last ``R`` slots, ``-inf`` where that slot holds no residual entry; None
    when no head of the layer has one.
    residual_positions: ``[B, H_kv, R]`` row-local position of each entry's oldest member
    (-1 where no entry); None likewise.
    residual_value_maps: ``[B, H_kv, M, d, d]`` query-dependent value terms of the last ``M``
    slots (MomentKV's value-key covariance, ``restkv.cache.Segment``); None without them.
    key_channels: ``[B, H_kv, c]`` the key channels each head keeps with ``--think`` (the
    dropped ones are zero in ``keys`` outside the recent tokens); None otherwise.

    Unpacks as ``keys, values, indices`` (what callers that ignore residual entries read).
    """

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    residual_log_counts: torch.Tensor | None = None
    residual_positions: torch.Tensor | None = None
    residual_value_maps: torch.Tensor | None = None
    key_channels: torch.Tensor | None = None

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

    Returns
    -------
    ``CompressedKV`` (keys, values, row-local indices, and with ``--residual`` the residual
    entries' log-counts and oldest positions). A row whose length does not exceed its budget
    keeps every real token.
    """
    config = CompressionConfig.from_any(config)
    valid = _validate_inputs(query, key, value, attention_mask)
    plan = plan_layer(config, valid, layer_idx, num_layers, sliding_window)
    selection = compress_layer(config, ScoringContext.of(query, key, value, plan, scaling, softcap, o_proj_weight))
    padding = plan.padding[:, None, None]

    def row_local(columns: torch.Tensor | None) -> torch.Tensor | None:
        return None if columns is None else torch.where(columns >= 0, columns - padding, columns)

    return CompressedKV(selection.keys, selection.values, row_local(selection.columns),
                        selection.residual_log_counts, row_local(selection.residual_columns),
                        selection.residual_value_maps, selection.key_channels)


def compress_layer(config: CompressionConfig, ctx: ScoringContext, scores: torch.Tensor | None = None,
                   keep: torch.Tensor | None = None) -> Selection:
    """What one layer keeps, following its plan (``ctx.plan``); columns index the padded batch.

    ``scores`` and ``keep`` (``[B, H_kv]`` kept counts) may come from a model-wide pass
    (``restkv.deferred``); by default the policy scores and the allocation allocates here.
    With ``--think`` the kept keys then lose their least important channels.
    """
    selection = _select(config, ctx, scores, keep)
    pruning = config.switch("think")
    if pruning is None or not ctx.plan.compress:
        return selection
    return pruning.prune(ctx, selection, pruning.recent_tokens(config))


def _select(config: CompressionConfig, ctx: ScoringContext, scores: torch.Tensor | None,
            keep: torch.Tensor | None) -> Selection:
    plan = ctx.plan
    if not plan.compress:  # every visible token stays
        keep = plan.visible_counts[:, None].expand(-1, ctx.num_kv_heads)
        columns = select_columns(rank_keys(torch.zeros(ctx.key.shape[:3], device=ctx.key.device), plan.visible,
                                           plan.protected), keep)
        return Selection(gather_columns(ctx.key, columns), gather_columns(ctx.value, columns), columns)
    policy = config.policy
    if scores is None:
        scores = policy.score(ctx)
    if keep is None:
        keep = config.allocator.allocate(ctx, scores)
    keep = policy.reserve(ctx, keep)
    residual_part = config.switch("residual")
    residual = residual_part.build(ctx, scores, keep) if residual_part is not None else None
    if residual is not None:
        keep = keep - residual.sizes
    moments = config.switch("moments")
    if moments is not None:  # the statistics take their slots; moment-informed eviction rescores
        scores, keep, summarised = moments.prepare(ctx, scores, keep)
    columns = select_columns(rank_keys(scores, plan.visible, plan.protected, plan.layer_idx), keep)
    keys, values = policy.finalize(ctx, columns, gather_columns(ctx.key, columns), gather_columns(ctx.value, columns))
    if config.merger is not None:
        keys, values = config.merger.merge(ctx, columns, keys, values)
    if moments is not None and (summary := moments.summarise(ctx, columns, summarised)) is not None:
        entry, covariance = summary
        selection = _with_residual_entries(keys, values, columns, entry, keep)
        return dataclasses.replace(selection, residual_value_maps=covariance)
    if residual is None or not bool(residual.sizes.any()):
        return Selection(keys, values, columns, output_correction=policy.summarise(ctx, columns))
    return _with_residual_entries(keys, values, columns, residual, keep)


def _with_residual_entries(
    keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, plan: ResidualPlan, main: torch.Tensor
) -> Selection:
    """Place each head's residual entries in its last slots; the layer stays ``max(m + r)``
    slots wide, the width the base method stores."""
    width = int((main + plan.sizes).max())
    grow = width - keys.shape[2]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, grow))
    values = torch.nn.functional.pad(values, (0, 0, 0, grow))
    columns = torch.nn.functional.pad(columns, (0, grow), value=-1)
    slots = plan.log_counts.shape[-1]
    reserved = torch.arange(slots, device=keys.device) >= slots - plan.sizes[..., None]  # [B, H_kv, R]
    keys[:, :, width - slots :] = torch.where(reserved[..., None], plan.keys, keys[:, :, width - slots :])
    values[:, :, width - slots :] = torch.where(reserved[..., None], plan.values, values[:, :, width - slots :])
    return Selection(keys, values, columns, plan.log_counts, plan.first_columns)


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
