"""ResKV (Zhan, Chen, Shang, arXiv 2607.29591): residual entries that stand in for what eviction drops.

Split by job: ``readout`` (how attention reads the entries: count bias, gate, shared or
separate softmax), ``clustering`` (Lloyd k-means of the evicted keys and the entries made
from it), ``validation`` (the proxy that picks each head's residual ratio), ``builder``
(one layer's entries) and ``options`` (the ``--residual`` switch and its flags).

Storage (``restkv.pipeline.compress``, ``restkv.cache``): a head's entries take the last ``r`` of its
``b`` slots, so a layer stores exactly as many entries as the base method, plus one float32
log-count per residual slot.
"""

from restkv.cache.segments.residual_entries import ResidualEntries, ResidualReadout, capped
from restkv.switches.residual.builder import ResidualPlan, build_residual, ratio_sizes
from restkv.switches.residual.clustering import (Clusters, Entries, cluster_sums, entries_of, fold_into_entries,
                                                 lloyd_kmeans)
from restkv.switches.residual.options import ResidualCache
from restkv.switches.residual.validation import choose_ratios, full_attention_output, split_observations

__all__ = [
    "Clusters", "Entries", "ResidualCache", "ResidualEntries", "ResidualPlan", "ResidualReadout", "build_residual",
    "capped", "choose_ratios", "cluster_sums", "entries_of", "full_attention_output",
    "fold_into_entries", "lloyd_kmeans", "ratio_sizes", "split_observations",
]
