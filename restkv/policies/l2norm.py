"""L2Norm / KNorm (Devoto et al., EMNLP 2024, arXiv 2406.11430).

Keeps the keys with the *lowest* L2 norm (low-norm keys draw high attention). No
attention weights are needed, so it works with any attention backend. As in the
reference, the whole prompt competes (no window protection; ``--l2norm_protect_window``
keeps it) and layers 0 and 1 stay uncompressed (``--l2norm_skip_layers``).
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext


@register_policy
class L2Norm(Policy):
    name = "l2norm"

    def protected_count(self, config, budget: int) -> int:
        return config.window_size if config.l2norm_protect_window else 0

    def compresses_layer(self, config, layer_idx: int) -> bool:
        return layer_idx not in config.l2norm_skip_layers

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        return -ctx.key.float().norm(dim=-1)
