"""ThinK (Xu et al., 2024, arXiv 2407.21018) as the original release runs it: SnapKV's
selection, then key-channel pruning (``restkv.channel_pruning``, ``--pruning_ratio``,
``--recent_size``). Any other scorer gets the same pruning with ``--think``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.options import register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class ThinK(SnapKV):
    name = "think"
    base_method = "snapkv"
    own_switches = ("think",)
