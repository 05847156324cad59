"""Threshold eviction (the inference rule of DMS, Łańcucki et al., 2025, arXiv 2506.05345), the ``--dms`` switch.

Instead of a fixed count, a token older than the protected window stays if its score reaches
``--dms_threshold``: how much is kept follows the content, per layer and KV head (ragged). The
budget caps it (a head keeps at most its allocated count, the best-scored first), and a prompt
within the budget is kept whole, as for every method (also a row of a padded batch whose other
rows are compressed). The threshold is on the scorer's own
scale (``-||k||`` for ``l2norm``, an attention weight for ``snapkv``...); DMS's trained
evictors are not part of it.

``--dms_decoding`` evicts during generation too, without a budget (kvpress' ``decoding=True``): every
``--decode_interval`` new tokens (1: every step, as kvpress), each held token past the window whose
score is below the threshold goes. Scores are taken once as each token comes, so the scorer must score
each token alone (KVzap, L2Norm, a learned scorer: ``Policy.scores_each_token_alone``).

Where this differs from kvpress' ``DMSPress``: the window is the method's protected window
(``--window_size``; kvpress' ``sliding_window_size``, 128 by default, on any scorer); tokens are evicted
where kvpress masks them; with ``--decode_budget`` a layer is thresholded again as it is compressed again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, lookup, option, register
from restkv.policies.base import require_ranking


@register("switch")
@dataclass(frozen=True)
class ThresholdEviction(Options):
    """DMS's rule: keep the tokens whose score reaches a threshold (at most the budget)."""

    name = "dms"
    reference = "DMS's inference rule: Łańcucki et al., 2025, arXiv 2506.05345"
    switch_help = "DMS-style eviction: beyond the protected window, keep only the tokens whose score reaches " \
                  "--dms_threshold (at most the budget)"

    dms_threshold: float | None = option(None, "--dms: the score a token must reach to stay (the scorer's scale)")
    dms_decoding: bool = option(False, "--dms: evict during generation too, without a budget: every "
                                "--decode_interval new tokens, the tokens past the window below --dms_threshold "
                                "(kvpress' DMSPress(decoding=True); a scorer of each token alone)")

    def check(self, config) -> None:
        if self.dms_threshold is None:
            raise ConfigError("--dms keeps the tokens whose score reaches a threshold: give --dms_threshold")
        require_ranking("--dms", config.policy)
        if not self.dms_decoding:
            return
        run = config.run
        if run.decode_budget is not None or run.decode_compression_ratio is not None:
            flag = "--decode_budget" if run.decode_budget is not None else "--decode_compression_ratio"
            raise ConfigError(f"--dms_decoding evicts by the threshold alone; with {flag} every compression during "
                              "generation is thresholded already: give one of them")
        if run.prefill_chunk_size is not None:
            raise ConfigError(f"--dms_decoding ranks the scores each token got as it came; --prefill_chunk_size "
                              f"{run.prefill_chunk_size} scores the prompt's chunks again with their queries")
        scorer = lookup("method", run.decode_method or run.method)
        if not scorer.scores_each_token_alone:
            flag = "--decode_method" if run.decode_method else "--method"
            raise ConfigError(f"--dms_decoding scores each token once as it comes; {flag} {scorer.name} scores with "
                              "the newest queries: use --decode_budget, or a scorer of each token alone (l2norm, "
                              "kvzap, learned_zip...)")

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores as they are; each head's count lowered to its protected tokens and the
        candidates that reach the threshold, in the rows that exceed their budget (a row of a
        padded batch that fits is kept whole, as alone)."""
        reaching = ((scores >= self.dms_threshold) & ctx.candidates[:, None]).sum(dim=-1)
        thresholded = torch.minimum(keep, ctx.protected.sum(dim=-1, keepdim=True) + reaching.to(keep.device))
        fits = (ctx.plan.visible_counts <= ctx.budgets).to(keep.device)[:, None]
        return scores, torch.where(fits, keep, thresholded)
