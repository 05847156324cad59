"""Merging evicted tokens into kept ones, after selection.

* ``pivot_merge`` (``--merge pivot``, LOOK-M style): every evicted token
  is averaged into the kept token whose key is most similar (cosine); keys and values
  move together. The ``PivotMerge`` part applies it after any scorer's selection.
* ``similarity_merge`` (``--merge similarity``, kvpress' MergingPress): every evicted value is
  folded into the kept token whose key is most similar, weighted by that cosine and its share of
  the two values' norms; keys are untouched.
* ``cam_merge`` (the CaM paper's semantics): each evicted value is spread over the next
  ``m`` kept values with a probability given by its attention relative to theirs; keys are
  untouched.
* ``cam_reference_values`` (the original release's CaM): the sequential forward
  cascade over the whole prompt, before selection.

Everything is per row and KV head, padding-aware (left padding: ``columns`` index the padded
batch), and works on ragged kept sets (``columns == -1`` marks unused slots, whose entries
stay zero).
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.context import ScoringContext
from restkv.options import Options, option, register
from restkv.selection import descending_ranks

#: query positions per block when matching evicted keys to pivots (bounds the similarity matrix)
PIVOT_BLOCK = 1024


def kept_mask(columns: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: which columns each (row, KV head) keeps."""
    batch, heads, _ = columns.shape
    mask = torch.zeros(batch, heads, length + 1, dtype=torch.bool, device=columns.device)
    mask.scatter_(2, columns.masked_fill(columns < 0, length), True)
    return mask[..., :length]


def evicted_mask(visible: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: visible tokens (``[B, N]``) a head did not keep."""
    return visible[:, None, :] & ~kept_mask(columns, visible.shape[-1])


@register("merge")
@dataclass(frozen=True)
class PivotMerge(Options):
    """``--merge pivot``: LOOK-M's pivot merge after any scorer's selection."""

    name = "pivot"

    def merge(
        self, ctx: ScoringContext, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pivot_merge(ctx.key, ctx.value, evicted_mask(ctx.visible, columns), columns, keys, values)


def pivot_merge(
    key: torch.Tensor,
    value: torch.Tensor,
    evicted: torch.Tensor,
    columns: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LOOK-M pivot merge.

    Parameters
    ----------
    key, value: ``[B, H_kv, N, d]`` the layer's full prompt K/V.
    evicted: ``[B, H_kv, N]`` bool, tokens to merge.
    columns: ``[B, H_kv, K]`` kept columns (ascending; -1 = unused slot).
    keys, values: ``[B, H_kv, K, d]`` the kept entries.

    Each evicted ``e`` picks the pivot ``r = argmax_kept cos(k_e, k_r)`` (ties: the lowest
    position); then ``k_r <- (k_r + sum_e (k_e + k_r) / 2) / (1 + n_r)`` and the same for ``v``
    with the same assignment. Returns the merged ``(keys, values)`` in their dtype.
    """
    if not bool(evicted.any()):
        return keys, values
    pivots, _ = nearest_kept(key, columns, keys)
    weight = evicted.float()
    counts = torch.zeros(columns.shape, dtype=torch.float32, device=key.device).scatter_add_(2, pivots, weight)

    def merged(kept: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        index = pivots[..., None].expand(*pivots.shape, full.shape[-1])
        sums = torch.zeros(kept.shape, dtype=torch.float32, device=kept.device)
        sums.scatter_add_(2, index, full.float() * weight[..., None])
        n = counts[..., None]
        return ((kept.float() * (1.0 + n / 2.0) + sums / 2.0) / (1.0 + n)).to(kept.dtype)

    return merged(keys, key), merged(values, value)


def nearest_kept(key: torch.Tensor, columns: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of ``key`` ``[B, H_kv, N, d]``: the slot of the kept key (``keys`` ``[B, H_kv,
    K, d]`` at ``columns``, -1 unused) most cosine-similar to it (ties: the first slot, the lowest
    position), and that cosine; each ``[B, H_kv, N]``, in blocks of ``PIVOT_BLOCK`` tokens."""
    slot_valid = columns >= 0
    kept_directions = F.normalize(keys.float(), dim=-1)
    length = key.shape[2]
    slots = torch.empty(key.shape[:3], dtype=torch.long, device=key.device)
    best = torch.empty(key.shape[:3], dtype=torch.float32, device=key.device)
    for start in range(0, length, PIVOT_BLOCK):
        block = slice(start, min(start + PIVOT_BLOCK, length))
        similarity = torch.matmul(F.normalize(key[:, :, block].float(), dim=-1), kept_directions.transpose(-1, -2))
        similarity = similarity.masked_fill(~slot_valid[:, :, None, :], float("-inf"))
        best[:, :, block], slots[:, :, block] = similarity.max(dim=-1)
    return slots, best


@register("merge")
@dataclass(frozen=True)
class SimilarityMerge(Options):
    """``--merge similarity``: kvpress' MergingPress after any scorer's selection (values only)."""

    name = "similarity"

    merge_similarity_threshold: float = option(
        0.0, "--merge similarity: an evicted token merges only into a kept key at least this cosine-similar",
        minimum=-1, maximum=1)
    merge_fraction: float = option(1.0, "--merge similarity: the share of the mergeable evicted tokens (the most "
                                        "similar) that merge", minimum=0, maximum=1)

    def merge(
        self, ctx: ScoringContext, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        evicted = evicted_mask(ctx.visible, columns)
        return keys, similarity_merge(ctx.key, ctx.value, evicted, columns, keys, values,
                                      self.merge_similarity_threshold, self.merge_fraction)


def similarity_merge(key: torch.Tensor, value: torch.Tensor, evicted: torch.Tensor, columns: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, threshold: float = 0.0,
                     fraction: float = 1.0) -> torch.Tensor:
    """MergingPress: each evicted value folds into the kept token whose key is most cosine-similar,
    with weight ``w_e = max(cos, 0) ||v_e|| / (||v_e|| + ||v_r|| + 1e-6)`` when the cosine reaches
    ``threshold`` (and is among the top ``fraction`` of the head's mergeable ones), then
    ``v_r <- (v_r + sum_e w_e v_e) / (1 + sum_e w_e)``; keys stay. Returns the merged kept values."""
    slots, best = nearest_kept(key, columns, keys)
    mergeable = evicted & (best >= threshold)
    if fraction < 1.0:
        ranked = best.masked_fill(~mergeable, float("-inf"))
        wanted = (mergeable.sum(dim=-1, keepdim=True) * fraction).ceil().long()
        mergeable = mergeable & (descending_ranks(ranked) < wanted)
    kept_norms = values.float().norm(dim=-1).gather(2, slots)
    evicted_norms = value.float().norm(dim=-1)
    weight = best.clamp(min=0) * mergeable.float() * evicted_norms / (evicted_norms + kept_norms + 1e-6)
    sums = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    sums.scatter_add_(2, slots[..., None].expand(*slots.shape, value.shape[-1]), value.float() * weight[..., None])
    totals = torch.zeros(columns.shape, dtype=torch.float32, device=values.device).scatter_add_(2, slots, weight)
    return ((values.float() + sums) / (1.0 + totals[..., None])).to(values.dtype)


def cam_merge(
    value: torch.Tensor,
    evicted: torch.Tensor,
    columns: torch.Tensor,
    values: torch.Tensor,
    mean_attention: torch.Tensor,
    merge_tokens: int,
    draws: torch.Tensor | None,
) -> torch.Tensor:
    """CaM, paper semantics: merge each evicted value into the next kept ones.

    Parameters
    ----------
    value: ``[B, H_kv, N, d]`` the layer's original prompt values (no cascade).
    evicted: ``[B, H_kv, N]`` bool.
    columns, values: ``[B, H_kv, K]`` kept columns (ascending, -1 unused) and their values.
    mean_attention: ``[B, H_kv, N]`` window-mean attention ``a`` per KV head.
    merge_tokens: ``m``; ``T_e`` = the first ``m`` kept positions after ``e``.
    draws: ``[B, H_kv, N]`` uniform numbers; ``z_e = draws_e < pi_e``. None merges with the
        expectation ``z_e = pi_e`` (``--cam_expected``).

    ``pi_e = clamp(a_e / mean_{t in T_e} a_t, 0, 1)`` (NaN -> 0, inf -> 1), and every
    ``t in T_e`` gets ``z_e v_e / |T_e|``. Returns the merged kept values.
    """
    length = value.shape[2]
    slot_valid = columns >= 0
    kept_count = slot_valid.sum(dim=-1, keepdim=True)
    padded_columns = columns.masked_fill(~slot_valid, length).contiguous()
    positions = torch.arange(length, device=value.device).expand(*evicted.shape).contiguous()
    first_after = torch.searchsorted(padded_columns, positions, right=True)  # slot of the first kept column > e
    targets = (kept_count - first_after).clamp(min=0, max=merge_tokens)
    kept_attention = mean_attention.gather(2, columns.clamp(min=0)).double().masked_fill(~slot_valid, 0.0)
    prefix = F.pad(kept_attention.cumsum(dim=-1), (1, 0))
    target_mean = (prefix.gather(2, first_after + targets) - prefix.gather(2, first_after)) / targets
    probability = torch.nan_to_num(mean_attention.double() / target_mean, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    merged = probability if draws is None else (draws.double() < probability).double()
    weight = torch.where(evicted & (targets > 0), merged / targets.clamp(min=1), torch.zeros_like(merged))
    # Evicted tokens between the same two kept tokens share their target range: sum them per
    # first slot, then every slot t receives the sums of the first slots in [t - m + 1, t].
    width = columns.shape[-1]
    per_first_slot = value.new_zeros(*columns.shape[:2], width + 1, value.shape[-1], dtype=torch.float64)
    index = first_after[..., None].expand(*first_after.shape, value.shape[-1])
    per_first_slot.scatter_add_(2, index, value.double() * weight[..., None])
    running = F.pad(per_first_slot[:, :, :width].cumsum(dim=2), (0, 0, 1, 0))
    lower = (torch.arange(width, device=value.device) + 1 - merge_tokens).clamp(min=0)
    received = running[:, :, 1:] - running[:, :, lower]
    received = received.masked_fill(~slot_valid[..., None], 0.0)
    return (values.double() + received).to(values.dtype)


def cam_reference_values(
    value: torch.Tensor, mean_attention: torch.Tensor, span: int, draws: torch.Tensor | None
) -> torch.Tensor:
    """The original release's CaM cascade over one row's real tokens.

    Parameters
    ----------
    value: ``[H_kv, L, d]`` the row's values; mean_attention ``[H_kv, L]`` window-mean attention.
    span: ``R = m``, the window size (the release merges over the window length).
    draws: ``[H_kv, L]`` uniform numbers, or None for the expectation.

    With ``start = ceil(0.1 L)``, for ``p = start .. L - R - 1`` in order:
    ``mu = max(max_{j < start} a_j, max_{p <= j < p + R} a_j)``,
    ``pi_p = clamp(a_p / mu, 0, 1)`` and ``v_{p+1 .. p+m} += z_p v_p / m`` (truncated at ``L``;
    ``v_p`` already holds earlier merges). Returns the merged ``[H_kv, L, d]`` values.
    """
    length = value.shape[1]
    start = math.ceil(0.1 * length)
    stop = length - span
    merged = value.double().clone()
    if stop <= start:
        return merged.to(value.dtype)
    attention = mean_attention.double()
    head_max = attention[:, :start].amax(dim=-1, keepdim=True)
    window_max = attention.unfold(-1, span, 1).amax(dim=-1)[:, start:stop]
    mu = torch.maximum(head_max, window_max)
    probability = torch.nan_to_num(attention[:, start:stop] / mu, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    if draws is not None:
        probability = (draws[:, start:stop].double() < probability).double()
    factors = probability / span
    for offset, p in enumerate(range(start, stop)):
        merged[:, p + 1 : p + 1 + span] += (factors[:, offset, None] * merged[:, p])[:, None, :]
    return merged.to(value.dtype)
