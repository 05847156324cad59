"""``--allocation pyramid`` (PyramidKV, arXiv 2406.02069): layer ``l`` keeps ``B_l + W`` with ``B_l``
falling linearly from ``n_max`` to ``n_min``; the layers sum exactly to ``N * B`` (largest
remainder), or floor the step like the original release with ``--pyramid_reference_rounding``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from restkv.allocations.base import Allocation
from restkv.config.options import option, register


@register("allocation")
@dataclass(frozen=True)
class Pyramid(Allocation):
    """PyramidKV's layer schedule (``pyramid_schedule``)."""

    name = "pyramid"
    reference = "PyramidKV: Cai et al., 2024, arXiv 2406.02069"
    selected_by = "use_pyramid"

    pyramid_beta: int = option(20, "PyramidKV: the last layer keeps about budget / beta candidate tokens",
                               minimum=1)
    pyramid_reference_rounding: bool = option(
        False, "PyramidKV: floor the per-layer step as the original release does (overshoots the total budget)"
    )
    use_pyramid: bool = option(
        False, "the original release's flag: PyramidKV's layer schedule without its middle (uniform) regime"
    )

    def candidate_counts(self, layer, scores, shape, available):
        schedule = pyramid_schedule(
            shape.budget,
            shape.window,
            shape.length,
            layer.num_layers,
            beta=self.pyramid_beta,
            reference_rounding=self.pyramid_reference_rounding,
            middle_regime=not self.use_pyramid,
        )
        return torch.clamp(available, max=schedule[layer.layer_idx])


# ---------------------------------------------------------------- PyramidKV
@lru_cache(maxsize=256)
def pyramid_schedule(
    budget: int,
    window: int,
    length: int,
    num_layers: int,
    beta: int = 20,
    reference_rounding: bool = False,
    middle_regime: bool = True,
) -> tuple[int, ...]:
    """PyramidKV's candidate budget ``B_l`` of every layer.

    Parameters
    ----------
    budget: ``C`` tokens per head under a uniform allocation, window included.
    window: ``W`` protected tokens (kept on top of ``B_l``).
    length: ``L`` tokens of the row.
    beta: the last layer keeps about ``(C - W) / beta`` candidates.
    reference_rounding: floor the step like the original release (the total overshoots
        ``N * B``); otherwise a real-valued step with largest-remainder rounding, so the
        layers sum to exactly ``N * B``.
    middle_regime: PyramidKV's rule that rows with ``L < 2B`` keep the uniform ``B`` (the
        ReST-KV release's ``--use_pyramid`` has no such regime).

    Returns a non-increasing tuple of ``num_layers`` candidate counts, each at most ``L - W``.
    """
    candidates = budget - window
    n_min = candidates // beta
    n_max = 2 * candidates - n_min
    if n_max >= length - window:
        n_max = length - window
        n_min = 2 * candidates - n_max
    if (middle_regime and length < 2 * candidates) or num_layers == 1:
        return (candidates,) * num_layers
    if reference_rounding:
        step = (n_max - n_min) // (num_layers - 1)
        return tuple(n_max - layer * step for layer in range(num_layers))
    # B_l = n_max - l (n_max - n_min) / (N - 1) in exact integer arithmetic; the real values
    # sum to N B because n_max + n_min = 2B.
    spread, intervals = n_max - n_min, num_layers - 1
    numerators = [n_max * intervals - layer * spread for layer in range(num_layers)]
    counts = [value // intervals for value in numerators]
    remainders = [value % intervals for value in numerators]
    missing = num_layers * candidates - sum(counts)
    # Largest remainder first; ties go to the lower layer, which keeps the schedule monotone.
    for layer in sorted(range(num_layers), key=lambda i: (-remainders[i], i))[:missing]:
        counts[layer] += 1
    return tuple(counts)
