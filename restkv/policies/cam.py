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

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.merges.cam import cam_merge, cam_reference_values
from restkv.merges.evicted import evicted_mask
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores
from restkv.scoring.selection import gather_columns

CAM_MODES = ("paper", "reference")


@register("method")
@dataclass(frozen=True)
class CaM(GroupedScores):
    name = "cam"
    merges_values = True

    cam_mode: str = option("paper", "CaM: the paper's merge after selection, or the release's cascade", CAM_MODES)
    cam_seed: int = option(0, "CaM: seed of the Bernoulli merge decisions", minimum=0)
    cam_expected: bool = option(False, "CaM: merge with the probability itself instead of a Bernoulli draw")
    cam_merge_tokens: int = option(32, "CaM (paper mode): kept tokens after an evicted one that share its value",
                                   minimum=1)

    def check(self, config) -> None:
        super().check(config)
        if self.cam_mode == "reference" and config.rescores:
            raise ConfigError("--cam_mode reference cascades over the whole prompt in one pass; with "
                              "--prefill_chunk_size or --decode_budget use --cam_mode paper")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        return self.reduce(ctx, ctx.observation.total())

    def finalize(
        self, ctx: LayerInputs, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean_attention = self.reduce(ctx, ctx.observation.mean())
        draws = None if self.cam_expected else self._row_local_draws(ctx)
        if self.cam_mode == "paper":
            evicted = evicted_mask(ctx.visible, columns)
            return keys, cam_merge(ctx.value, evicted, columns, values, mean_attention, self.cam_merge_tokens, draws)
        merged = ctx.value.clone()
        length = ctx.valid.shape[-1]
        rows = zip(ctx.plan.visible_counts.tolist(), ctx.budgets.tolist())
        for row, (real, budget) in enumerate(rows):
            if budget >= real:  # a row that fits is not compressed, so nothing is merged
                continue
            part = slice(length - real, length)
            merged[row, :, part] = cam_reference_values(
                ctx.value[row, :, part],
                mean_attention[row, :, part],
                ctx.window_size,
                None if draws is None else draws[row, :, part],
            )
        return keys, gather_columns(merged, columns)

    def _row_local_draws(self, ctx: LayerInputs) -> torch.Tensor:
        """``[B, H_kv, N]`` uniform numbers from ``--cam_seed`` and the layer, in row-local order."""
        batch, length = ctx.valid.shape
        draws = torch.ones(batch, ctx.num_kv_heads, length, dtype=torch.float64)
        for row, real in enumerate(ctx.plan.visible_counts.tolist()):
            generator = torch.Generator().manual_seed(self.cam_seed * 100_003 + ctx.layer_idx)
            draws[row, :, length - real :] = torch.rand(ctx.num_kv_heads, real, generator=generator,
                                                         dtype=torch.float64)
        return draws.to(ctx.valid.device)
