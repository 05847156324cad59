"""``--allocation laprox``: LaProx's model-wide selection over layer-normalised scores."""

from __future__ import annotations

from dataclasses import dataclass

from restkv.allocations.model_ranked import ModelRanked
from restkv.config.options import option, register


@register("allocation")
@dataclass(frozen=True)
class LaProxAllocation(ModelRanked):
    """LaProx's model-wide selection: ``model_ranked`` over layer-normalised scores, with an optional
    per-head floor (an AdaKV-style safeguard that the paper, as read, does not have)."""

    name = "laprox"
    reference = "LaProx: Mai & Kim, arXiv 2605.07234"

    laprox_floor: float = option(
        0.0, "LaProx: every (layer, KV head) keeps at least floor * (budget - window) candidates before the "
        "model-wide ranking (0 = off: the paper, as read, has no floor)", minimum=0, maximum=1,
    )

    def reserved(self, candidate_budget: int) -> int:
        return int(self.laprox_floor * candidate_budget)
