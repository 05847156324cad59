"""H2O (Zhang et al., 2023, arXiv 2306.14048), prefill-only variant.

Heavy hitters = tokens with the largest accumulated attention. The default accumulates
the attention of the observation window (``--h2o_queries window``: SnapKV without
pooling, the ResKV protocol); ``--h2o_queries all`` sums the causal attention of every
prompt query (computed in query chunks, never ``N x N``). ``--h2o_normalize`` divides each
token's sum by the number of the accumulated queries that see it (kvpress'
ObservedAttention): in window mode that is the window queries at or after the token (all
of them for a past token, so the ranking does not change), in ``all`` mode every later
query, on a sliding-window layer only those inside the window. The window is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores
from restkv.scoring.window import window_attention

QUERY_CHUNK = 512
H2O_QUERIES = ("window", "all")


@register("method")
@dataclass(frozen=True)
class H2O(GroupedScores):
    name = "h2o"
    reference = "H2O: Zhang et al., 2023, arXiv 2306.14048"

    h2o_queries: str = option(
        "window", "H2O accumulates the attention of the observation window or of all prompt queries", H2O_QUERIES
    )
    h2o_normalize: bool = option(
        False, "H2O divides each token's sum by the number of the accumulated queries that see it"
    )

    @property
    def reads_every_query(self) -> bool:
        return self.h2o_queries == "all"

    def check(self, config) -> None:
        super().check(config)
        if self.h2o_queries == "all" and (config.compresses_after_prefill or config.rescores):
            cannot = (f"wait for the whole prefill ({' and '.join(config.deferring_flags())})"
                      if config.compresses_after_prefill else
                      f"score chunk by chunk ({' and '.join(config.rescoring_flags())})")
            raise ConfigError(
                f"--h2o_queries all accumulates the attention of every prompt query at once; it cannot {cannot}"
            )

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        if self.h2o_queries == "window":
            accumulated = ctx.observation.total()
            queries = min(ctx.window_size, ctx.valid.shape[-1])
        else:
            accumulated = all_query_column_sums(ctx)
            queries = ctx.valid.shape[-1]
        if self.h2o_normalize:
            seeing = queries_seeing_each_key(ctx.valid, queries, ctx.plan.sliding_window)
            accumulated = accumulated / seeing[:, None, :]
        return self.reduce(ctx, accumulated)


def all_query_column_sums(ctx: LayerInputs) -> torch.Tensor:
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
            ctx.plan.sliding_window,
        )
        total[:, :, :end] += weights.sum(dim=2)
    return total


def queries_seeing_each_key(valid: torch.Tensor, num_queries: int, sliding_window: int | None = None) -> torch.Tensor:
    """``[B, N]`` float32: how many of the last ``num_queries`` real queries attend to each key
    (causally, and inside the sliding window when there is one); at least 1."""
    length = valid.shape[-1]
    first_real = length - valid.sum(dim=-1)
    keys = torch.arange(length, device=valid.device)
    first_query = torch.maximum(keys[None, :], torch.clamp(first_real, min=length - num_queries)[:, None])
    end = torch.full_like(keys, length) if sliding_window is None else torch.clamp(keys + sliding_window, max=length)
    return (end[None, :] - first_query).clamp(min=1).to(torch.float32)
