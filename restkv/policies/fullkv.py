"""``fullkv``: no compression, the reference every other method is compared with.

It evicts nothing, so it needs no budget (a budget given with it is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.base import Policy


@register("method")
@dataclass(frozen=True)
class FullKV(Policy):
    name = "fullkv"
    reference = "no paper: the uncompressed cache, the reference every method is compared with"
    evicts = False
    observes_queries = False

    def compresses_layer(self, layer_idx: int) -> bool:
        return False
