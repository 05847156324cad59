"""TOVA (Oren et al., 2024, arXiv 2401.06104), applied once after prefill.

Score = attention from the last prompt query, averaged over all heads of the layer, so
every KV head keeps the same tokens (``--tova_per_head`` averages per query group
instead). The last token is always kept.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext


@register_policy
class TOVA(Policy):
    name = "tova"

    def protected_count(self, config, budget: int) -> int:
        return 1

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        last_row = ctx.window_attention(1)[:, :, 0, :]
        if ctx.config.tova_per_head:
            return ctx.reduce_groups(last_row)
        layer_mean = last_row.mean(dim=1, keepdim=True)
        return layer_mean.expand(-1, ctx.num_kv_heads, -1)
