"""H2O (Zhang et al., 2023, arXiv 2306.14048), prefill-only variant.

Heavy hitters = tokens with the largest accumulated attention. The default accumulates
the attention of the observation window (``--h2o_queries window``: SnapKV without
pooling, the ResKV protocol); ``--h2o_queries all`` sums the causal attention of every
prompt query (computed in query chunks, never ``N x N``), optionally divided by the
number of queries that can see each token (``--h2o_normalize``, kvpress'
ObservedAttention). The window is always kept.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext
from restkv.scoring import window_attention

QUERY_CHUNK = 512


@register_policy
class H2O(Policy):
    name = "h2o"

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        if ctx.config.h2o_queries == "window":
            accumulated = ctx.window_attention().sum(dim=2)
        else:
            accumulated = all_query_column_sums(ctx)
        if ctx.config.h2o_normalize:
            accumulated = accumulated / queries_seeing_each_key(ctx.valid)[:, None, :]
        return ctx.reduce_groups(accumulated)


def all_query_column_sums(ctx: ScoringContext) -> torch.Tensor:
    """``[B, H, N]``: causal attention received by each key, summed over every prompt query."""
    length = ctx.query.shape[2]
    total = torch.zeros(ctx.query.shape[:3], dtype=torch.float32, device=ctx.query.device)
    for end in range(length, 0, -QUERY_CHUNK):
        start = max(0, end - QUERY_CHUNK)
        # The last `end` columns seen by queries [start, end): reuse the window routine on a prefix.
        weights = window_attention(
            ctx.query[:, :, :end],
            ctx.key[:, :, :end],
            ctx.valid[:, :end],
            end - start,
            ctx.scaling,
            ctx.softcap,
            ctx.sliding_window,
        )
        total[:, :, :end] += weights.sum(dim=2)
    return total


def queries_seeing_each_key(valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: number of real queries at or after each position (at least 1)."""
    after = valid.flip(-1).cumsum(-1).flip(-1)
    return after.clamp(min=1).to(torch.float32)
