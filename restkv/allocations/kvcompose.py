"""``--method kvcompose``'s allocation: layer budgets from the layers' composite scores (structured)
or per-head budgets (``--kvcompose_unstructured``), over the model-wide ranking."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.model_ranked import ModelRanked
from restkv.config.options import option, register


@register("allocation")
@dataclass(frozen=True)
class KVComposeAllocation(ModelRanked):
    """KVCompose's: layer budgets from one ranking of the layers' composite scores (structured), or
    head budgets from one ranking of every head's sorted scores (unstructured)."""

    name = "kvcompose"
    reference = "KVCompose: Akulov et al., 2025, arXiv 2509.05165"

    kvcompose_unstructured: bool = option(
        False, "KVCompose: give each (layer, KV head) its own count from one model-wide ranking of every head's "
        "sorted scores, instead of one count per layer (structured)")

    def allocate_model(self, contexts, scores):
        layers = sorted(contexts)
        first = contexts[layers[0]]
        keeps = {layer: torch.zeros(first.valid.shape[0], first.num_kv_heads, dtype=torch.long) for layer in layers}
        for row in range(first.valid.shape[0]):
            ranked = {layer: scores[layer][row][:, contexts[layer].candidates[row]].float().cpu().sort(
                dim=-1, descending=True).values for layer in layers}  # [H_kv, n] each
            heads = first.num_kv_heads
            total = sum(min(int(contexts[layer].budgets[row]), ranked[layer].shape[1]) for layer in layers)
            if self.kvcompose_unstructured:
                counts = self._winners([ranked[layer] for layer in layers], total * heads)
            else:
                composite = [ranked[layer].mean(dim=0, keepdim=True) for layer in layers]
                width = max(part.shape[1] for part in composite)
                padded = torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1]), value=float("-inf"))
                                    for part in composite])
                composite[0] = padded.amax(dim=0, keepdim=True)[:, : composite[0].shape[1]]
                counts = [count.expand(heads) for count in self._winners(composite, total)]
            for layer, count in zip(layers, counts):
                protected = int(contexts[layer].protected[row].sum())
                keeps[layer][row] = count + protected
        return {layer: keep.to(contexts[layer].budgets.device) for layer, keep in keeps.items()}

    @staticmethod
    def _winners(parts: list[torch.Tensor], total: int) -> list[torch.Tensor]:
        """``[R]`` per part ``[R, n]``: how many of each row's entries are among the ``total`` largest
        of all parts (ties: the earlier part, row and entry)."""
        flat = torch.cat([part.reshape(-1) for part in parts])
        order = torch.sort(flat, descending=True, stable=True).indices[:total]
        won = torch.zeros_like(flat, dtype=torch.long)
        won[order] = 1
        counts, start = [], 0
        for part in parts:
            counts.append(won[start : start + part.numel()].view(part.shape).sum(dim=1))
            start += part.numel()
        return counts
