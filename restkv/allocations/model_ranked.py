"""``--allocation model_ranked``: every compressed layer and KV head shares the model's budget by one
ranking of their scores (KVzip)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.base import Allocation
from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import RowShape


@register("allocation")
@dataclass(frozen=True)
class ModelRanked(Allocation):
    """Every compressed layer and KV head shares the model's budget by one ranking of their
    scores (KVzip): per row, the top ``sum over layers of H_kv * B`` candidates across the model,
    each (layer, head) keeping the ones it won. Scores must be comparable across layers.
    Ties go to the lower layer, head and position."""

    name = "model_ranked"
    reference = "KVzip: Kim et al., NeurIPS 2025, arXiv 2505.23416"
    head_adaptive = True
    model_wide = True

    def reserved(self, candidate_budget: int) -> int:
        """Candidates every (layer, KV head) keeps before the model-wide ranking (none here)."""
        return 0

    def allocate(self, ctx: LayerInputs, scores: torch.Tensor) -> torch.Tensor:
        """A single layer ranks its heads alone (the model of one layer)."""
        return self.allocate_model({ctx.layer_idx: ctx}, {ctx.layer_idx: scores})[ctx.layer_idx]

    def allocate_model(self, contexts, scores):
        layers = sorted(contexts)
        first = contexts[layers[0]]
        keeps = {layer: torch.zeros(first.valid.shape[0], first.num_kv_heads, dtype=torch.long) for layer in layers}
        for row in range(first.valid.shape[0]):
            competing, total = [], 0
            for layer in layers:
                ctx = contexts[layer]
                protected = int(ctx.protected[row].sum())
                shape = RowShape(row, int(ctx.budgets[row]), protected, int(ctx.plan.visible_counts[row]))
                keeps[layer][row] = protected
                if shape.candidate_budget >= shape.candidates:  # the row fits in this layer
                    keeps[layer][row] += shape.candidates
                    continue
                part = scores[layer][row][:, ctx.candidates[row]].float().cpu()
                reserved = min(self.reserved(shape.candidate_budget), part.shape[1])
                if reserved:  # each head's own top candidates win first
                    top = torch.sort(part, dim=-1, descending=True, stable=True).indices[:, :reserved]
                    part = part.scatter(1, top, float("inf"))
                competing.append((layer, part))
                total += ctx.num_kv_heads * shape.candidate_budget
            if not competing:
                continue
            flat = torch.cat([part.flatten() for _, part in competing])
            owner = torch.cat([torch.full((part.numel(),), index, dtype=torch.long)
                               for index, (_, part) in enumerate(competing)])
            head = torch.cat([torch.arange(part.shape[0]).repeat_interleave(part.shape[1]) for _, part in competing])
            won = torch.sort(flat, descending=True, stable=True).indices[:total]
            for index, (layer, part) in enumerate(competing):
                mine = won[owner[won] == index]
                keeps[layer][row] += torch.bincount(head[mine], minlength=part.shape[0])
        device = first.budgets.device
        return {layer: keep.to(device) for layer, keep in keeps.items()}
