"""HeadKV (Fu et al., 2024, arXiv 2410.19258): per-head budgets from head importance scores.

Scores are SnapKV's window-mean attention (as AdaKV's); the budget of each (layer, KV head)
comes from a file of retrieval-reasoning head scores (``--head_scores``; compute one with
``python -m restkv.head_scores``), spread model-wide (``restkv.allocation.headkv_table``).
Any other scorer gets the same allocation with ``--allocation headkv``.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.adakv import window_mean_scores
from restkv.policies.base import Policy, ScoringContext


@register_policy
class HeadKV(Policy):
    name = "headkv"
    uses_pooling = True
    allocation = "headkv"

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        return window_mean_scores(ctx)
