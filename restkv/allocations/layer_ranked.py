"""``--allocation layer_ranked``: a layer's KV heads share its candidates by one ranking of their
scores (AdaKV without its floor or normalisation; KVzip's ``--kvzip_layerwise``)."""

from __future__ import annotations

from dataclasses import dataclass

from restkv.allocations.adakv import adakv_caps
from restkv.allocations.base import Allocation
from restkv.config.options import register


# ---------------------------------------------------------------- one ranking for many heads
@register("allocation")
@dataclass(frozen=True)
class LayerRanked(Allocation):
    """The KV heads of a layer share its ``H_kv * B`` candidates by one ranking of their scores
    (AdaKV without its floor or normalisation; KVzip's ``--kvzip_layerwise``)."""

    name = "layer_ranked"
    reference = "KVzip's layer-wise variant (Kim et al., NeurIPS 2025, arXiv 2505.23416)"
    head_adaptive = True

    def candidate_counts(self, layer, scores, shape, available):
        return adakv_caps(scores, shape.candidate_budget, 0.0, normalize=False)
