"""ThinK (Xu et al., 2024, arXiv 2407.21018): SnapKV's selection, then key-channel pruning
(``restkv.switches.think``, ``--pruning_ratio``, ``--recent_size``), the pairing of the
original release. The release picks channels per query head (keys repeated per head) and
prunes layers that evict nothing too; here channels are picked per KV head and only evicting
layers are pruned (``restkv.switches.think`` says why). Any other scorer gets the same
pruning with ``--think``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class ThinK(SnapKV):
    name = "think"
    reference = "ThinK: Xu et al., 2024, arXiv 2407.21018"
    base_method = "snapkv"
    own_switches = ("think",)
