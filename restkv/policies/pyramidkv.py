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

from restkv.config.options import option, register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    reference = "PyramidKV: Cai et al., 2024, arXiv 2406.02069"
    allocation = "pyramid"
    base_method = "snapkv"

    pyramid_kvpress_schedule: bool = option(
        False, "PyramidKV: kvpress 0.5.5's layer schedule (the window counted inside the pyramid, so the last layer "
        "may keep only its window; a rounded budget when its bounds fail)"
    )

    def own_allocation(self) -> str:
        return "pyramid_kvpress" if self.pyramid_kvpress_schedule else self.allocation
