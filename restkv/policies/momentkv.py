"""``--method momentkv`` (MomentKV, arXiv 2606.01563): SnapKV's scores with ``--moments``, the evicted
set's moment statistics read as one softmax entry (``restkv.switches.moments``)."""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class MomentKV(SnapKV):
    """SnapKV's scores with ``--moments`` (the evicted set's moments, read as one softmax entry)."""

    name = "momentkv"
    reference = "MomentKV: Li, Li and Lan, arXiv 2606.01563"
    base_method = "snapkv"
    own_switches = ("moments",)
