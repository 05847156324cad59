"""KVCompose (Akulov et al., 2025, arXiv 2509.05165): attention-guided composite tokens, budgets per layer.

After the context's prefill the model reads the context once more (``--observation
reconstruction``, the method's default; no instruction is put before the repetition, as KVCompose
replays the bare context); a token's score is the largest attention any replay query gives it,
averaged over its query group (``--gqa_score_agg mean``), plus the mean of that score over the
layer's KV heads (``--kvcompose_head_mean``: a token many heads read gains in every head;
``--kvcompose_vnorm`` multiplies by the value's norm first).

The budget is spread by layer (``--allocation kvcompose``, the method's own, model-wide): each
layer's *composite* is the mean over its KV heads of their scores sorted in descending order
(position ``i`` of the composite is the ``i``-th best token of an average head); the first
compressed layer's composite is raised to the elementwise maximum over layers (KVCompose keeps
its first layer the largest); one ranking of every layer's composite entries gives each layer the
number of its entries in the model-wide top (the model's budget, ``L x B`` per head). Every head
of a layer keeps that many of its own best tokens (KVCompose's "structured" cache: its heads
hold as many tokens each, so a layer is one dense block). ``--kvcompose_unstructured`` ranks every
head's sorted scores across the model instead, so each (layer, head) keeps its own count (ragged).

As kvpress' ``KVComposePress`` (``agg_task max, agg_group mean, agg_head mean``,
``keep_token_lower_bound 0``): the replay reads the whole context in one forward (its keys twice
over: ``--reconstruction_chunk N`` bounds that, each piece then scored without the others);
kvpress masks the unstructured variant's evicted entries at full memory, here they are removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocation import ModelRanked
from restkv.context import ScoringContext
from restkv.options import option, register
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class KVCompose(GroupedScores):
    name = "kvcompose"
    allocation = "kvcompose"
    default_observation = "reconstruction"
    repeats_with_instruction = False
    default_reconstruction_chunk = None

    kvcompose_head_mean: bool = option(True, "KVCompose: add to each token's score its mean over the layer's KV heads")
    kvcompose_vnorm: bool = option(False, "KVCompose: multiply each token's score by its value's norm")

    def protected_count(self, window_size: int, budget: int) -> int:
        return 0

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        scores = self.reduce(ctx, ctx.observation.maximum())
        if self.kvcompose_vnorm:
            scores = scores * ctx.value.float().norm(dim=-1)
        if self.kvcompose_head_mean:
            scores = scores + scores.mean(dim=1, keepdim=True)
        return scores


@register("allocation")
@dataclass(frozen=True)
class KVComposeAllocation(ModelRanked):
    """KVCompose's: layer budgets from one ranking of the layers' composite scores (structured), or
    head budgets from one ranking of every head's sorted scores (unstructured)."""

    name = "kvcompose"

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
