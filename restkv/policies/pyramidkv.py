"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores with a pyramidal layer budget.

Lower layers, whose attention is spread widely, keep more tokens; higher layers, whose
attention concentrates, keep fewer (``restkv.allocation.Pyramid``). Prompts shorter than
twice the candidate budget keep the uniform budget, as in PyramidKV. Any other scorer gets
the same schedule with ``--allocation pyramid``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.options import register
from restkv.policies.snapkv import SnapKV


@register("method")
@dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    allocation = "pyramid"
    base_method = "snapkv"
