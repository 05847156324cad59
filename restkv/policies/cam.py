"""CaM (Zhang et al., ICML 2024): SnapKV-style selection, then cache merging of evicted values into kept ones.

Selection keeps the tokens with the largest window-summed attention (no pooling) plus the window; the
method is defined with its own merge, ``--merge cam`` (``restkv.merges.cam``: the paper's merge after
selection, or with ``--cam_mode reference`` the original release's forward cascade over the whole prompt).
Keys are never changed and the budget is the same as SnapKV's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class CaM(GroupedScores):
    name = "cam"
    reference = "CaM (cache merging): Zhang et al., ICML 2024"
    own_merge = "cam"

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        return self.reduce(ctx, ctx.observation.total())
