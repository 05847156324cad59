"""SnapKV (Li et al., 2024, arXiv 2404.14469).

Score of a past token = attention it receives from the observation window (the last
``window_size`` prompt queries), summed over the window, reduced over each query group,
then smoothed with ``--pooling``/``--kernel_size``; the window itself is always kept.
Defaults follow the ReST-KV runs: window 32, avgpool, kernel 5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import PooledScores


@register("method")
@dataclass(frozen=True)
class SnapKV(PooledScores):
    name = "snapkv"
    reference = "SnapKV: Li et al., 2024, arXiv 2404.14469"

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        summed = ctx.observation.total()
        return self.smooth(ctx, self.reduce(ctx, summed))
