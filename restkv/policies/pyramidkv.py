"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores with a pyramidal layer budget.

Lower layers, whose attention is spread widely, keep more tokens; higher layers, whose
attention concentrates, keep fewer (``restkv.allocation.Pyramid``). Prompts shorter than
twice the candidate budget keep the uniform budget, as in PyramidKV. Any other scorer gets
the same schedule with ``--allocation pyramid``.

``--pyramid_kvpress_schedule`` runs kvpress 0.5.5's schedule instead (``pyramid_kvpress``,
below): it spreads the whole budget, window included, over the pyramid, so the last layer can
keep its window and nothing else (320/235/149/64 tokens on a 384-token prompt at half the
budget with a 64-token window), and when its bounds fail it falls back to
``round(budget)`` (at ratio 0.8 on a 384-token prompt it keeps ``round(76.8) = 77`` where
SnapKV keeps 76).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocation import Pyramid
from restkv.options import ConfigError, option, register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    allocation = "pyramid"
    base_method = "snapkv"

    pyramid_kvpress_schedule: bool = option(
        False, "PyramidKV: kvpress 0.5.5's layer schedule (the window counted inside the pyramid, so the last layer "
        "may keep only its window; a rounded budget when its bounds fail)"
    )

    def own_allocation(self) -> str:
        return "pyramid_kvpress" if self.pyramid_kvpress_schedule else self.allocation


@register("allocation")
@dataclass(frozen=True)
class KvpressPyramid(Pyramid):
    """kvpress 0.5.5's PyramidKV schedule (``kvpress_pyramid_totals``); ``--pyramid_beta`` applies."""

    name = "pyramid_kvpress"

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
