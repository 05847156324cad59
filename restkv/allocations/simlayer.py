"""``--method simlayerkv``'s allocation: StreamingLLM's tokens in lazy layers (their last queries
read mostly the sinks and the newest tokens), every token elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.allocations.base import Allocation
from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import SinkOptions


@register("allocation")
@dataclass(frozen=True)
class SimLayerAllocation(SinkOptions, Allocation):
    """SimLayerKV's: a lazy layer's row keeps the budget (StreamingLLM's tokens), any other every token."""

    name = "simlayer"
    reference = "SimLayerKV: Zhang et al., 2025, arXiv 2410.13846"
    may_keep_whole = True

    simlayer_threshold: float = option(
        0.9, "SimLayerKV: a layer is lazy (compressed) when its last queries give more than this share of their "
        "attention to the sinks and the newest tokens", minimum=0, maximum=1)
    simlayer_last_queries: int = option(1, "SimLayerKV: the last prompt queries whose attention tells a lazy layer",
                                        minimum=1)

    def allocate(self, ctx: LayerInputs, scores: torch.Tensor) -> torch.Tensor:
        counts = [int(budget) if self.lazy_share(ctx, row, int(budget)) > self.simlayer_threshold else int(visible)
                  for row, (budget, visible) in enumerate(zip(ctx.budgets.tolist(), ctx.plan.visible_counts.tolist()))]
        return torch.tensor(counts, device=ctx.budgets.device)[:, None].expand(-1, ctx.num_kv_heads).clone()

    def lazy_share(self, ctx: LayerInputs, row: int, budget: int) -> float:
        """The share of row ``row``'s last queries' attention (mean over heads and queries) on its
        sinks and the ``budget - n_sink + last_queries`` tokens before those queries."""
        length = ctx.key.shape[2]
        visible = int(ctx.plan.visible_counts[row])
        columns = slice(length - visible, length)
        last = min(self.simlayer_last_queries, ctx.query.shape[2], visible)
        query = ctx.query[row, :, -last:].float()  # the prompt's last queries (every context holds them)
        key = ctx.key[row, :, columns].float().repeat_interleave(query.shape[0] // ctx.num_kv_heads, dim=0)
        logits = query @ key.transpose(-1, -2) * ctx.scaling
        if ctx.softcap is not None:
            logits = torch.tanh(logits / ctx.softcap) * ctx.softcap
        causal = torch.arange(visible, device=key.device)[None] > torch.arange(visible - last, visible,
                                                                              device=key.device)[:, None]
        weights = logits.masked_fill(causal, float("-inf")).softmax(dim=-1).mean(dim=(0, 1))
        before = visible - last  # the last queries' own keys are not counted (kvpress')
        recent = min(budget - self.n_sink + last, before)
        sinks = min(self.n_sink, before - recent)
        return float(weights[:sinks].sum() + weights[before - recent : before].sum())
