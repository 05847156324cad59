"""Building one layer's residual entries (ResKV).

Per row and KV head the base method's budget ``b`` is split into ``m`` exact main slots and
``r`` residual slots (``m + r = b``). The main cache is what the base method keeps at budget
``m`` (protected tokens + top scores); the evicted tokens are partitioned by Lloyd k-means
on their keys into ``r`` clusters, each becoming one entry (mean key, mean value, member
count). The ratio ``r / b`` is chosen per layer, row and KV head by the validation proxy
(``restkv.switches.residual.validation``). Rows are processed one by one, so a row of a left-padded
batch gives exactly what it gives alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from restkv.scoring.selection import rank_keys
from restkv.switches.residual.clustering import Entries, RankedRow, ResidualOptions, entries_of, lloyd_kmeans
from restkv.switches.residual.validation import choose_ratios, validation_losses

if TYPE_CHECKING:
    from restkv.pipeline.inputs import LayerInputs


def ratio_sizes(ratio: float, budgets: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """``r = floor(ratio * b)`` per head, at most ``room`` (= b - protected; 0 for heads that keep everything)."""
    sizes = torch.tensor([math.floor(round(ratio * b, 9)) for b in budgets.tolist()], device=budgets.device)
    return torch.minimum(sizes, room).clamp(min=0)


class ResidualPlan(NamedTuple):
    """What ``compress_kv`` needs to store a layer's residual entries.

    sizes: ``[B, H_kv]`` slots each row and head gives to residual entries (``m = b - sizes``).
    keys, values: ``[B, H_kv, R, d]`` entries, right-aligned (a head with ``r`` entries uses
        the last ``r`` slots), in the model dtype; zeros in unused slots.
    log_counts: ``[B, H_kv, R]`` float32 ``log c`` (-inf in unused slots).
    first_columns: ``[B, H_kv, R]`` long padded-batch column of each entry's oldest member (-1 unused).
    """

    sizes: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    log_counts: torch.Tensor
    first_columns: torch.Tensor


def build_residual(options: "ResidualOptions", ctx: "LayerInputs", scores: torch.Tensor,
                   keep: torch.Tensor) -> ResidualPlan:
    """Choose the residual size of every row and KV head and build its entries.

    scores: ``[B, H_kv, N]`` the base method's scores (selection and k-means init use them);
    keep: ``[B, H_kv]`` the base budget ``b`` per row and head, protected tokens included.
    """
    batch, num_kv_heads, length, dim = ctx.key.shape
    rows = [_row_entries(options, ctx, row, scores, keep[row]) for row in range(batch)]
    width = max(entries.keys.shape[1] for _, entries in rows)
    plan = ResidualPlan(
        sizes=torch.stack([sizes for sizes, _ in rows]),
        keys=ctx.key.new_zeros(batch, num_kv_heads, width, dim),
        values=ctx.value.new_zeros(batch, num_kv_heads, width, dim),
        log_counts=torch.full((batch, num_kv_heads, width), float("-inf"), device=ctx.key.device),
        first_columns=torch.full((batch, num_kv_heads, width), -1, dtype=torch.long, device=ctx.key.device),
    )
    for row, (_, entries) in enumerate(rows):
        slots = entries.keys.shape[1]
        if slots == 0:
            continue
        offset = length - int(ctx.visible[row].sum())  # index in the visible suffix -> padded column
        plan.keys[row, :, width - slots :] = entries.keys.to(ctx.key.dtype)
        plan.values[row, :, width - slots :] = entries.values.to(ctx.value.dtype)
        plan.log_counts[row, :, width - slots :] = entries.log_counts
        plan.first_columns[row, :, width - slots :] = torch.where(entries.first >= 0, entries.first + offset, -1)
    return plan


def _row_entries(
    options: "ResidualOptions", ctx: "LayerInputs", row: int, scores: torch.Tensor, budgets: torch.Tensor
) -> tuple[torch.Tensor, Entries]:
    """``([H_kv] residual sizes, right-aligned Entries)`` of one row."""
    data = _rank_row(ctx, row, scores, budgets)
    ratios = (options.residual_fixed_ratio,) if options.residual_no_validation else options.residual_ratios
    sizes_of = [ratio_sizes(ratio, data.budgets, data.room) for ratio in ratios]
    built = [_cluster(data, sizes, options) if bool((sizes > 0).any()) else None for sizes in sizes_of]
    none = torch.zeros_like(data.budgets)
    if all(entries is None for entries in built):
        return none, _empty_entries(data, 0)
    if options.residual_no_validation:
        choice = torch.zeros_like(none)
    else:
        fit, val, baseline_val = validation_losses(options, ctx, row, data, sizes_of, built)
        choice = choose_ratios(fit, val, baseline_val, options.residual_delta, options.residual_select_on)
    sizes = none
    for index, candidate in enumerate(sizes_of):
        sizes = torch.where(choice == index, candidate, sizes)
    width = int(sizes.max())
    chosen = _empty_entries(data, width)
    for index, entries in enumerate(built):
        picked = choice == index
        if entries is None or width == 0 or not bool(picked.any()):
            continue
        placed = _right_aligned(entries, sizes_of[index], width)
        chosen = Entries(*(torch.where(picked.view(-1, *[1] * (new.dim() - 1)), new, old)
                           for new, old in zip(placed, chosen)))
    return sizes, chosen


def _rank_row(ctx: "LayerInputs", row: int, scores: torch.Tensor, budgets: torch.Tensor) -> RankedRow:
    visible = int(ctx.visible[row].sum())
    start = ctx.valid.shape[-1] - visible  # visible tokens are a suffix (left padding, sliding window)
    protected = ctx.protected[row, start:]
    rows = slice(row, row + 1)
    ranked = rank_keys(scores[rows], ctx.visible[rows], ctx.protected[rows], ctx.layer_idx)[0, :, start:]
    # The same ranking as restkv.scoring.selection: stable, so ties go to the lower position.
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    index = order[..., None].expand(-1, -1, ctx.key.shape[-1])
    budgets = budgets.to(order.device)
    room = torch.where(budgets < visible, budgets - int(protected.sum()), 0).clamp(min=0)
    return RankedRow(
        ctx.key[row, :, start:].float().gather(1, index), ctx.value[row, :, start:].float().gather(1, index),
        order, budgets, room,
    )


def _cluster(data: RankedRow, sizes: torch.Tensor, options: "ResidualOptions") -> Entries:
    """k-means of each head's evicted tokens (ranks ``>= b - r``) into ``sizes`` clusters, seeded
    with the best-ranked evicted tokens (ranks ``b - r .. b - 1``). Works on the ranked suffix
    that holds every head's evicted tokens. Cluster ``j`` is in slot ``j``."""
    main = data.budgets - sizes
    start = int(main.min())
    slot = torch.arange(int(sizes.max()), device=sizes.device)[None, :]
    init = ((main - start)[:, None] + slot).masked_fill(slot >= sizes[:, None], -1)
    ranks = torch.arange(start, data.order.shape[1], device=sizes.device)
    members = ranks[None, :] >= main[:, None]
    clusters = lloyd_kmeans(data.keys[:, start:], members, init, options.residual_iters, options.residual_empty)
    return entries_of(clusters, data.values[:, start:], data.order[:, start:])


def _right_aligned(entries: Entries, sizes: torch.Tensor, width: int) -> Entries:
    """Entries ``width`` slots wide with head ``h``'s clusters ``0 .. sizes[h] - 1`` in its last
    ``sizes[h]`` slots (``sizes[h] <= width``); earlier slots unused."""
    source = torch.arange(width, device=sizes.device)[None, :] - (width - sizes)[:, None]
    used = source >= 0
    source = source.clamp(min=0, max=max(entries.keys.shape[1] - 1, 0))

    def move(part: torch.Tensor, fill: float) -> torch.Tensor:
        index = source if part.dim() == 2 else source[..., None].expand(-1, -1, part.shape[-1])
        mask = used if part.dim() == 2 else used[..., None]
        return torch.where(mask, part.gather(1, index), fill)

    return Entries(move(entries.keys, 0.0), move(entries.values, 0.0), move(entries.log_counts, float("-inf")),
                   move(entries.first, -1))


def _empty_entries(data: RankedRow, width: int) -> Entries:
    heads, dim, device = data.budgets.shape[0], data.keys.shape[-1], data.keys.device
    return Entries(
        torch.zeros(heads, width, dim, device=device),
        torch.zeros(heads, width, dim, device=device),
        torch.full((heads, width), float("-inf"), device=device),
        torch.full((heads, width), -1, dtype=torch.long, device=device),
    )
