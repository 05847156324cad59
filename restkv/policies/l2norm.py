"""L2Norm / KNorm (Devoto et al., EMNLP 2024, arXiv 2406.11430).

Keeps the keys with the *lowest* L2 norm (low-norm keys draw high attention). No
attention weights are needed, so it works with any attention backend. As in the
reference, the whole prompt competes (no window protection; ``--l2norm_protect_window``
keeps it) and layers 0 and 1 stay uncompressed (``--l2norm_skip_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy


@register("method")
@dataclass(frozen=True)
class L2Norm(Policy):
    name = "l2norm"
    reference = "KNorm / L2Norm: Devoto et al., EMNLP 2024, arXiv 2406.11430"
    observes_queries = False
    scores_each_token_alone = True

    l2norm_skip_layers: tuple[int, ...] = option((0, 1), "layers L2Norm leaves uncompressed")
    l2norm_protect_window: bool = option(False, "L2Norm also keeps the observation window")

    def protected_count(self, window_size: int, budget: int) -> int:
        return window_size if self.l2norm_protect_window else 0

    def compresses_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.l2norm_skip_layers

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        return -ctx.key.float().norm(dim=-1)
