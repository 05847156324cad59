"""HeadKV (Fu et al., 2024, arXiv 2410.19258): per-head budgets from head importance scores.

Scores are SnapKV's window-mean attention (as AdaKV's); the budget of each (layer, KV head)
comes from a file of retrieval-reasoning head scores (``--head_scores``; compute one with
``python -m restkv.tools.head_scores``), spread model-wide
(``restkv.allocation.HeadKVAllocation``). Any other scorer gets the same allocation with
``--allocation headkv``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.adakv import AdaKV


@register("method")
@dataclass(frozen=True)
class HeadKV(AdaKV):
    """AdaKV's scores; only the allocation differs."""

    name = "headkv"
    reference = "HeadKV: Fu et al., 2024, arXiv 2410.19258"
    allocation = "headkv"
