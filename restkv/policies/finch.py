"""Finch (Corallo & Papotti, TACL 2024, arXiv 2408.00167): keep what the question attends to.

The observation window is the question: the prompt's last ``--window_size`` tokens (in a
query-aware run, the question after the context). A past token's score is the attention the
window's queries give it, each query's row first multiplied by the number of earlier tokens it
sees (``--finch_normalize``, Finch's normalisation: a query late in a long prompt spreads its
attention thinner, so its weights count for more), averaged over the window and reduced over
each query group (``--gqa_score_agg``); no pooling. The window itself is always kept.

Where this differs from kvpress' ``FinchPress``: the window is ``--window_size`` tokens, not
found from a delimiter token inserted between context and question. kvpress may compress chunk
by chunk of the context (``chunk_length``: ``--chunk_press --chunk_press_global
--chunk_press_length N`` here) and by default re-rotates the kept keys to consecutive positions
(``--rerotate_keys`` here, off by default as for every method). The normalising
count is the number of the row's real tokens before the query (on a sliding-window layer, at
most the window), which is kvpress' query position for an unpadded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class Finch(GroupedScores):
    name = "finch"
    reference = "Finch: Corallo & Papotti, TACL 2024, arXiv 2408.00167"

    finch_normalize: bool = option(
        True, "Finch: weight each window query's attention by the number of earlier tokens it sees"
    )

    def check(self, config) -> None:
        super().check(config)
        if config.run.window_size == 0:
            raise ConfigError(f"--method {self.name} scores the context by the attention of the question, its last "
                              "--window_size tokens: --window_size 0 leaves none")
        if config.run.observation == "reconstruction":
            raise ConfigError(f"--method {self.name} weights each window query's attention row; --observation "
                              "reconstruction keeps no row per query (use --observation window)")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        weights = ctx.observation.attention()  # [B, H, w, N]
        if self.finch_normalize:
            earlier = ctx.valid.cumsum(dim=-1) - 1  # real tokens before each column
            if ctx.plan.sliding_window is not None:
                earlier = earlier.clamp(max=ctx.plan.sliding_window - 1)
            weights = weights * earlier[:, None, -weights.shape[2] :, None].float()
        return self.reduce(ctx, weights.mean(dim=2))
