"""CriticalKV (Feng et al., 2025, arXiv 2502.03805), the ``--critical`` switch: rescore by what a token adds to the output.

A scorer ranks tokens by how much they are read; what a token adds to the layer's output also
depends on its value through the output projection. After the allocation has given each KV
head its count ``B_h`` (window included), two stages choose its tokens:

1. the first ``--critical_first_stage`` of the budget, ``floor(f B_h)`` (the window and the
   head's top tokens by the scorer's own ranking), is kept as the scorer chose it;
2. every other token is ranked by ``(score + --critical_epsilon) x ||v_i W_o||_1``, the L1 norm of
   its value projected by its query head's slice of ``o_proj`` (averaged over the query
   group), and the rest of the budget goes to the top of that ranking.

It composes with any scorer and allocation: with ``--allocation adakv`` it is the paper's
CriticalAdaKV (the head budgets from the scorer's own scores, then both stages per head),
with a model-wide one the heads' counts come from the model-wide ranking. ``o_proj``'s weight
is read, so ``compress_kv`` needs its ``o_proj_weight``.

``--critical_epsilon`` is on the scorer's scale: restkv's SnapKV scores sum the window's
attention where kvpress' average it, so kvpress' 1e-4 on a 64-query window is 0.0064 here.

Where this differs from kvpress' ``CriticalKVPress``: the first stage counts the protected
window inside its share as kvpress' does (its scorers score the window above every token), and
it keeps the rest of each head's budget by one ranking instead of kvpress' float-max forcing
(the same set).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, option, register
from restkv.policies.base import require_ranking
from restkv.scoring.output_space import output_weight
from restkv.scoring.selection import descending_ranks


@register("switch")
@dataclass(frozen=True)
class CriticalRescoring(Options):
    """CriticalKV: keep a first share of each head's budget by its scores, rank the rest by score x ||v W_o||_1."""

    name = "critical"
    reference = "CriticalKV: Feng et al., 2025, arXiv 2502.03805"
    switch_help = ("CriticalKV: keep --critical_first_stage of each head's budget by the scorer's ranking, the rest by "
                   "score x the L1 norm of the value's output projection")

    critical_first_stage: float = option(0.5, "--critical: share of each head's budget kept by the scorer's own "
                                              "ranking", minimum=0)
    critical_epsilon: float = option(1e-4, "--critical: added to each score before the output-norm weighting",
                                     minimum=0)

    def validate(self) -> None:
        if self.critical_first_stage > 1:
            raise ConfigError(f"--critical_first_stage must be a share in [0, 1]; got {self.critical_first_stage}")

    def check(self, config) -> None:
        require_ranking("--critical", config.policy)

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H_kv, N]`` scores whose ranking keeps, per head, the first stage's tokens, then the
        rest by output-weighted score (``keep`` ``[B, H_kv]``: each head's count, protected included)."""
        first = (keep.float() * self.critical_first_stage).long() - ctx.protected.sum(dim=-1, keepdim=True)
        candidates = ctx.candidates[:, None].expand_as(scores)
        ranked = scores.float().masked_fill(~candidates, float("-inf"))
        chosen = descending_ranks(ranked) < first.clamp(min=0)[..., None]
        weighted = (scores.float() + self.critical_epsilon) * output_l1_norms(ctx)
        return weighted.masked_fill(chosen, torch.finfo(weighted.dtype).max), keep  # finite: above every other


def output_l1_norms(ctx) -> torch.Tensor:
    """``[B, H_kv, N]`` ``||v_i W_o^h||_1`` of each token's value through each query head's slice of
    ``o_proj``, averaged over the KV head's query group."""
    weight = output_weight(ctx)  # [D, H, d]
    groups = weight.shape[1] // ctx.num_kv_heads
    values = ctx.value.float().repeat_interleave(groups, dim=1)  # [B, H, N, d]
    norms = torch.stack([(values[:, head] @ weight[:, head].T).abs().sum(dim=-1) for head in range(weight.shape[1])],
                        dim=1)
    return norms.view(norms.shape[0], ctx.num_kv_heads, groups, -1).mean(dim=2)
