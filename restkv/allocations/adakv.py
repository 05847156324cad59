"""``--allocation adakv`` (AdaKV, arXiv 2407.11550): within a layer, heads share ``H_kv * B`` candidates
through a global top-k over their scores; every head keeps at least ``floor * B``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.base import Allocation
from restkv.config.options import option, register


@register("allocation")
@dataclass(frozen=True)
class AdaKVAllocation(Allocation):
    """AdaKV's head-adaptive budgets within a layer (``adakv_caps``)."""

    name = "adakv"
    reference = "AdaKV: Feng et al., 2024, arXiv 2407.11550"
    head_adaptive = True

    floor: float = option(0.2, "AdaKV safeguard: every head keeps at least floor * (budget - window) candidates",
                          minimum=0, maximum=1)
    adakv_reference_allocation: bool = option(
        False, "AdaKV: the original rounding (head totals off by a few tokens, floor approximate)"
    )
    adakv_normalize: bool = option(
        True, "AdaKV: weight each head's scores by the share of its mass in its own top budget before ranking"
    )

    def candidate_counts(self, layer, scores, shape, available):
        return adakv_caps(
            scores,
            shape.candidate_budget,
            self.floor,
            normalize=self.adakv_normalize,
            reference=self.adakv_reference_allocation,
        )


# ---------------------------------------------------------------- AdaKV
def adakv_caps(
    scores: torch.Tensor, budget: int, floor: float, normalize: bool = True, reference: bool = False
) -> torch.Tensor:
    """AdaKV's candidate count per head of one row.

    Parameters
    ----------
    scores: ``[H_kv, n]`` scores of the row's candidates (``H_kv * budget`` of them or more); a
        head with fewer candidates ends its row with ``-inf``.
    budget: ``B`` candidates per head on average; the heads share ``H_kv * B``.
    floor: safeguard ``alpha``: every head keeps at least ``floor(alpha * B)`` (or all it has).
    normalize: weight head ``k``'s scores by (sum of its top-``B``) / (sum of all), as the
        KVCache-Factory / ReST-KV runs do, so heads with flat attention compete fairly.
    reference: the original rounding ``round((1 - alpha) n_k + floor)`` after a global top-
        ``H_kv B`` over all scores (totals off by a few tokens); otherwise each head's top
        ``floor`` is reserved and the rest goes to the global top of the remaining
        candidates, so the total is exactly ``H_kv * B`` and every head gets its floor.

    Returns ``[H_kv]`` long counts, each between the floor and the head's candidates. Ties in
    the global ranking go to the lower head, then the lower rank (deterministic).
    """
    num_heads, width = scores.shape
    reserved = int(floor * budget)
    ranked = torch.sort(scores.float(), dim=-1, descending=True, stable=True).values
    finite = torch.isfinite(ranked)
    ragged = not bool(finite.all())
    if normalize:
        real = ranked.masked_fill(~finite, 0.0) if ragged else ranked
        totals = real.sum(dim=-1, keepdim=True)
        share = real[:, :budget].sum(dim=-1, keepdim=True) / totals
        ranked = ranked * torch.where(totals != 0, share, torch.ones_like(share))
    available = finite.sum(dim=-1)
    if reference:
        won = _global_top(ranked, min(num_heads * budget, int(available.sum())))
        return torch.minimum(torch.round(won.float() * (1.0 - floor) + reserved).long(), available)
    if not ragged:
        return reserved + _global_top(ranked[:, reserved:], num_heads * (budget - reserved))
    held = torch.clamp(available, max=reserved)
    pool = ranked.masked_fill(torch.arange(width, device=ranked.device) < held[:, None], float("-inf"))
    count = min(num_heads * budget - int(held.sum()), int(torch.isfinite(pool).sum()))
    return held + _global_top(pool, count)


def _global_top(ranked: torch.Tensor, count: int) -> torch.Tensor:
    """How many of the ``count`` largest entries of ``ranked`` ``[H, n]`` each head holds."""
    num_heads, width = ranked.shape
    order = torch.sort(ranked.flatten(), descending=True, stable=True).indices[:count]
    return torch.bincount(order // width, minlength=num_heads)
