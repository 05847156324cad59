"""``fullkv``: no compression, the reference every other method is compared with."""

from __future__ import annotations

from restkv.policies import register_policy
from restkv.policies.base import Policy


@register_policy
class FullKV(Policy):
    name = "fullkv"

    def compresses_layer(self, config, layer_idx: int) -> bool:
        return False

    def validate(self, config) -> None:
        return None
