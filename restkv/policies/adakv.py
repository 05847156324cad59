"""AdaKV (Feng et al., 2024, arXiv 2407.11550): head-adaptive budgets within a layer.

Scores are SnapKV's window-*mean* attention, reduced per query group and pooled; the
layer's ``H_kv * B`` candidates go to the heads through a global top-k over these scores
(optionally normalised per head, ``--adakv_normalize``), with every head guaranteed
``--floor`` of its uniform share (``restkv.allocation.adakv_caps``). Any other scorer gets
the same allocation with ``--allocation adakv``.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext


def window_mean_scores(ctx: ScoringContext) -> torch.Tensor:
    """``[B, H_kv, N]`` window-mean attention per KV head, pooled (AdaKV's and HeadKV's scores)."""
    return ctx.pool(ctx.reduce_groups(ctx.window_attention().mean(dim=2)))


@register_policy
class AdaKV(Policy):
    name = "adakv"
    uses_pooling = True
    allocation = "adakv"

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        return window_mean_scores(ctx)
