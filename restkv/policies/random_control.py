"""``random``: a control that keeps the window plus uniformly random past tokens.

Scores come from a generator seeded with ``--seed`` and the layer index and are drawn in
row-local order, so a row of a padded batch keeps what it keeps alone.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext


@register_policy
class RandomPolicy(Policy):
    name = "random"

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        batch, length = ctx.valid.shape
        scores = torch.zeros(batch, ctx.num_kv_heads, length, dtype=torch.float32)
        for row, real in enumerate(ctx.lengths.tolist()):
            generator = torch.Generator().manual_seed(ctx.config.seed * 100_003 + ctx.layer_idx)
            scores[row, :, length - real :] = torch.rand(ctx.num_kv_heads, real, generator=generator)
        return scores.to(ctx.valid.device)
