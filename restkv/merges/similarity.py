"""``--merge similarity`` (kvpress' MergingPress): every evicted value is folded into the kept token
whose key is most similar, weighted by that cosine and its share of the two values' norms;
keys are untouched."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import Options, option, register
from restkv.merges.evicted import evicted_mask
from restkv.merges.pivot import nearest_kept
from restkv.pipeline.inputs import LayerInputs
from restkv.scoring.selection import descending_ranks


@register("merge")
@dataclass(frozen=True)
class SimilarityMerge(Options):
    """``--merge similarity``: kvpress' MergingPress after any scorer's selection (values only)."""

    name = "similarity"
    reference = "kvpress' MergingPress (NVIDIA kvpress)"

    merge_similarity_threshold: float = option(
        0.0, "--merge similarity: an evicted token merges only into a kept key at least this cosine-similar",
        minimum=-1, maximum=1)
    merge_fraction: float = option(1.0, "--merge similarity: the share of the mergeable evicted tokens (the most "
                                        "similar) that merge", minimum=0, maximum=1)

    def merge(
        self, ctx: LayerInputs, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        evicted = evicted_mask(ctx.visible, columns)
        return keys, similarity_merge(ctx.key, ctx.value, evicted, columns, keys, values,
                                      self.merge_similarity_threshold, self.merge_fraction)


def similarity_merge(key: torch.Tensor, value: torch.Tensor, evicted: torch.Tensor, columns: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, threshold: float = 0.0,
                     fraction: float = 1.0) -> torch.Tensor:
    """MergingPress: each evicted value folds into the kept token whose key is most cosine-similar,
    with weight ``w_e = max(cos, 0) ||v_e|| / (||v_e|| + ||v_r|| + 1e-6)`` when the cosine reaches
    ``threshold`` (and is among the top ``fraction`` of the head's mergeable ones), then
    ``v_r <- (v_r + sum_e w_e v_e) / (1 + sum_e w_e)``; keys stay. Returns the merged kept values."""
    slots, best = nearest_kept(key, columns, keys)
    mergeable = evicted & (best >= threshold)
    if fraction < 1.0:
        ranked = best.masked_fill(~mergeable, float("-inf"))
        wanted = (mergeable.sum(dim=-1, keepdim=True) * fraction).ceil().long()
        mergeable = mergeable & (descending_ranks(ranked) < wanted)
    kept_norms = values.float().norm(dim=-1).gather(2, slots)
    evicted_norms = value.float().norm(dim=-1)
    weight = best.clamp(min=0) * mergeable.float() * evicted_norms / (evicted_norms + kept_norms + 1e-6)
    sums = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    sums.scatter_add_(2, slots[..., None].expand(*slots.shape, value.shape[-1]), value.float() * weight[..., None])
    totals = torch.zeros(columns.shape, dtype=torch.float32, device=values.device).scatter_add_(2, slots, weight)
    return ((values.float() + sums) / (1.0 + totals[..., None])).to(values.dtype)
