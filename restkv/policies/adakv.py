"""AdaKV (Feng et al., 2024, arXiv 2407.11550): head-adaptive budgets within a layer.

Scores are SnapKV's window-*mean* attention, reduced per query group and pooled; the
layer's ``H_kv * B`` candidates go to the heads through a global top-k over these scores
(optionally normalised per head, ``--adakv_normalize``), with every head guaranteed
``--floor`` of its uniform share (``restkv.allocation.AdaKVAllocation``). Any other scorer
gets the same allocation with ``--allocation adakv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import PooledScores


@register("method")
@dataclass(frozen=True)
class AdaKV(PooledScores):
    name = "adakv"
    reference = "AdaKV: Feng et al., 2024, arXiv 2407.11550"
    allocation = "adakv"
    base_method = "snapkv"

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        """``[B, H_kv, N]`` window-mean attention per KV head, pooled (AdaKV's and HeadKV's scores)."""
        return self.smooth(ctx, self.reduce(ctx, ctx.observation.mean()))
