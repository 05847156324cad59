"""``random``: a control that keeps the window plus uniformly random past tokens.

Scores come from a generator seeded with ``--seed`` and the layer index and are drawn in
row-local order, so a row of a padded batch keeps what it keeps alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy


def layer_generator(ctx: LayerInputs) -> torch.Generator:
    """A CPU generator seeded with the run's ``--seed`` and the layer: each layer draws its own
    numbers, the same ones every run (the run's global RNG is never touched)."""
    return torch.Generator().manual_seed(ctx.plan.seed * 100_003 + ctx.layer_idx)


def random_scores(ctx: LayerInputs) -> torch.Tensor:
    """``[B, H_kv, N]`` uniform scores from the run's seed and the layer, in row-local order."""
    batch, length = ctx.valid.shape
    scores = torch.zeros(batch, ctx.num_kv_heads, length, dtype=torch.float32)
    for row, real in enumerate(ctx.plan.visible_counts.tolist()):
        scores[row, :, length - real :] = torch.rand(ctx.num_kv_heads, real, generator=layer_generator(ctx))
    return scores.to(ctx.valid.device)


@register("method")
@dataclass(frozen=True)
class RandomPolicy(Policy):
    name = "random"
    reference = "no paper: a control that keeps the window and uniformly random past tokens"
    observes_queries = False

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        return random_scores(ctx)
