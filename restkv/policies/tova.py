"""TOVA (Oren et al., 2024, arXiv 2401.06104), applied once after prefill.

Score = attention from the last prompt query, averaged over all heads of the layer, so
every KV head keeps the same tokens (``--tova_per_head`` reduces per query group instead,
with ``--gqa_score_agg``). The last token is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class TOVA(GroupedScores):
    name = "tova"
    reference = "TOVA: Oren et al., 2024, arXiv 2401.06104"

    tova_per_head: bool = option(False, "TOVA averages the last query's attention per query group, not per layer")

    @property
    def shares_scores_across_heads(self) -> bool:
        return not self.tova_per_head

    def protected_count(self, window_size: int, budget: int) -> int:
        return 1

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        last_row = ctx.observation.last()
        if self.tova_per_head:
            return self.reduce(ctx, last_row)
        layer_mean = last_row.mean(dim=1, keepdim=True)
        return layer_mean.expand(-1, ctx.num_kv_heads, -1)
