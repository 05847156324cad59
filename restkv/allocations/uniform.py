"""``--allocation uniform``: every KV head keeps the row budget ``C``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.base import Allocation
from restkv.config.options import register


@register("allocation")
@dataclass(frozen=True)
class Uniform(Allocation):
    """Every KV head keeps the row budget ``C``."""

    name = "uniform"
    reference = "no paper: the same budget for every KV head, as SnapKV and most methods keep"

    def candidate_counts(self, layer, scores, shape, available):
        return torch.clamp(available, max=shape.candidate_budget)
