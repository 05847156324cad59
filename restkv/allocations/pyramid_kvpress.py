"""``--pyramid_kvpress_schedule``: kvpress' PyramidKV schedule (its per-layer totals and rounding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.pyramid import Pyramid
from restkv.config.options import ConfigError, register


@register("allocation")
@dataclass(frozen=True)
class KvpressPyramid(Pyramid):
    """kvpress 0.5.5's PyramidKV schedule (``kvpress_pyramid_totals``); ``--pyramid_beta`` applies."""

    name = "pyramid_kvpress"
    reference = "PyramidKV (Cai et al., arXiv 2406.02069) as kvpress' PyramidKVPress schedules it"

    def validate(self) -> None:
        if self.pyramid_reference_rounding:
            raise ConfigError("--pyramid_reference_rounding is the original release's rounding of the restkv "
                              "schedule; --pyramid_kvpress_schedule rounds as kvpress does")

    def candidate_counts(self, layer, scores, shape, available):
        totals = kvpress_pyramid_totals(shape.budget, shape.window, shape.length, layer.num_layers,
                                        self.pyramid_beta)
        return torch.clamp(available, max=max(totals[layer.layer_idx] - shape.window, 0))


def kvpress_pyramid_totals(budget: int, window: int, length: int, num_layers: int, beta: int) -> list[int]:
    """Tokens each layer keeps under kvpress 0.5.5's PyramidKV, window included: ``budget``
    candidates on average spread from ``n_max`` to ``n_min = budget / beta`` with
    ``n_max + n_min = 2 budget`` (``n_max`` capped at ``length - window``), each layer's total
    Python-rounded; ``round(budget)`` for every layer when ``length >= n_max >= n_min >= window``
    fails."""
    n_min = budget / beta
    n_max = 2 * budget - n_min
    if n_max >= length - window:
        n_max = length - window
        n_min = 2 * budget - n_max
    if not length >= n_max >= n_min >= window or num_layers == 1:
        return [round(budget)] * num_layers
    step = (n_max - n_min) / (num_layers - 1)
    return [round(n_max - layer * step) for layer in range(num_layers)]
