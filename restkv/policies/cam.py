"""CaM (Zhang et al., ICML 2024): cache merging of evicted values into kept ones.

Selection keeps the tokens with the largest window-summed attention (no pooling) plus the
window; then, in the default paper semantics (``--cam_mode paper``), every evicted value is
added to the next ``--cam_merge_tokens`` kept values with probability
``min(1, a_e / mean a_T)`` (``a`` = window-mean attention), drawn from a generator seeded
with ``--cam_seed`` (or in expectation with ``--cam_expected``). ``--cam_mode reference``
reproduces the original release's forward cascade over the whole prompt. Keys are never
changed and the budget is the same as SnapKV's. Draws are made per row in row-local order,
so a row of a left-padded batch merges exactly as it does alone.
"""

from __future__ import annotations

import torch

from restkv.merging import cam_merge, cam_reference_values, evicted_mask
from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext
from restkv.selection import gather_columns


@register_policy
class CaM(Policy):
    name = "cam"

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        return ctx.reduce_groups(ctx.window_attention().sum(dim=2))

    def finalize(
        self, ctx: ScoringContext, indices: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = ctx.config
        mean_attention = ctx.reduce_groups(ctx.window_attention().mean(dim=2))
        draws = None if config.cam_expected else _row_local_draws(ctx)
        if config.cam_mode == "paper":
            evicted = evicted_mask(ctx, indices)
            return keys, cam_merge(ctx.value, evicted, indices, values, mean_attention, config.cam_merge_tokens, draws)
        merged = ctx.value.clone()
        length = ctx.valid.shape[-1]
        for row, (real, budget) in enumerate(zip(ctx.lengths.tolist(), ctx.budgets.tolist())):
            if budget >= real:  # a row that fits is not compressed, so nothing is merged
                continue
            part = slice(length - real, length)
            merged[row, :, part] = cam_reference_values(
                ctx.value[row, :, part],
                mean_attention[row, :, part],
                config.window_size,
                None if draws is None else draws[row, :, part],
            )
        return keys, gather_columns(merged, indices)


def _row_local_draws(ctx: ScoringContext) -> torch.Tensor:
    """``[B, H_kv, N]`` uniform numbers from ``--cam_seed`` and the layer, in row-local order."""
    batch, length = ctx.valid.shape
    draws = torch.ones(batch, ctx.num_kv_heads, length, dtype=torch.float64)
    for row, real in enumerate(ctx.lengths.tolist()):
        generator = torch.Generator().manual_seed(ctx.config.cam_seed * 100_003 + ctx.layer_idx)
        draws[row, :, length - real :] = torch.rand(ctx.num_kv_heads, real, generator=generator, dtype=torch.float64)
    return draws.to(ctx.valid.device)
