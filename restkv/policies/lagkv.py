"""LagKV (Liang et al., 2025, arXiv 2504.04704): tokens scored against the partition that follows them.

After the first ``--n_sink`` tokens (attention sinks), each row is cut into partitions of
``--lag_size`` tokens. A partition is judged by the next one: each channel of its keys is
min-max normalised with the next partition's minimum and maximum, the standard deviation over
channels measures how much the token stands out, and a softmax over the partition turns it
into a score; key and value scores are averaged. Without ``--lagkv_cross_scoring`` (the
default) the score is the token's rank within its partition divided by ``--lag_size``, so
every partition competes on the same footing. The last full partition and the remainder (the
"tail") have no later partition yet and are not scored. No attention is read, and no recent
window is protected: the tail plays that role.

Ranking: sinks first, then the tail, newest first, then the scored tokens by score. When the
budget cannot hold the sinks and the whole tail, the sinks and the newest tokens stay; a budget
that does not exceed the sinks is refused (a fixed one at once, a ratio's on the row it leaves
too few), as for kvzip.

Where this differs from kvpress' ``LagKVPress`` (same defaults: 4 sinks, lag 128, ranks):
kvpress scores the sinks and the tail 1, the same value, so with a budget below them (the
default lag leaves 256 of a 384-token prompt unscored) its top-k keeps whichever of them its
tie-breaking picks, dropping the sinks and every scored token
(at ratio 0.5 it keeps positions 192-383). ``--lagkv_kvpress_scores`` reproduces those
scores. A channel whose next-partition minimum equals its maximum (a constant channel) carries
no information here and adds 0; kvpress divides by zero. In a padded batch each row is
partitioned from its own first token, and in a layer compressed again (chunked prefill, decode
budgets) the partitions run over the tokens the layer holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import KeepsSinks, Policy
from restkv.policies.row_local import score_rows

#: score of a sink: above every other score, so the sinks always stay
SINK_SCORE = 3.0
#: scores of the unscored tail lie in [UNSCORED, SINK_SCORE), newest highest
UNSCORED = 2.0


@register("method")
@dataclass(frozen=True)
class LagKV(KeepsSinks, Policy):
    name = "lagkv"
    reference = "LagKV: Liang et al., 2025, arXiv 2504.04704"
    observes_queries = False

    lag_size: int = option(128, "LagKV: tokens per partition; each partition is scored against the next one",
                           minimum=2)
    lagkv_cross_scoring: bool = option(
        False, "LagKV: rank tokens by their softmax scores across partitions instead of by their rank within "
        "their partition"
    )
    lagkv_kvpress_scores: bool = option(
        False, "LagKV: score the sinks and the unscored tail 1, as kvpress 0.5.5 does (a budget below them keeps "
        "whichever of them top-k picks, sinks included)"
    )

    def protected_count(self, window_size: int, budget: int) -> int:
        return 0

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        return score_rows(ctx, lambda row, columns: self.row_scores(ctx.key[row, :, columns].float(),
                                                                     ctx.value[row, :, columns].float()))

    def row_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` scores of one row's keys and values ``[H_kv, n, d]``, oldest first."""
        heads, length, _ = keys.shape
        partitions = max((length - self.n_sink) // self.lag_size - 1, 0)  # partitions with a successor
        scored_end = self.n_sink + partitions * self.lag_size
        positions = torch.arange(length, dtype=torch.float32, device=keys.device)
        if self.lagkv_kvpress_scores:
            scores = torch.ones(heads, length, device=keys.device)
            if partitions == 0 and length > self.n_sink:  # too short to score: kvpress ramps up to the newest
                scores[:, self.n_sink :] = (positions[self.n_sink :] - self.n_sink) / (length - self.n_sink)
        else:
            scores = (UNSCORED + positions / length).expand(heads, -1).clone()
            scores[:, : self.n_sink] = SINK_SCORE
        if partitions:
            window = slice(self.n_sink, scored_end + self.lag_size)
            scores[:, self.n_sink : scored_end] = self.partition_scores(keys[:, window], values[:, window])
        return scores

    def partition_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[H_kv, P * lag]`` scores of the first ``P`` of ``P + 1`` partitions ``[H_kv, (P+1) * lag, d]``."""
        score = (lag_relative_scores(keys, self.lag_size) + lag_relative_scores(values, self.lag_size)) / 2
        if not self.lagkv_cross_scoring:
            rank = score.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True)
            score = rank.float() / self.lag_size
        return score.flatten(start_dim=1)


def lag_relative_scores(states: torch.Tensor, lag_size: int) -> torch.Tensor:
    """``[H, P, lag]``: for each of the first ``P`` partitions of ``states`` ``[H, (P+1) * lag, d]``,
    the softmax over the partition of the standard deviation over channels of its states,
    min-max normalised with the next partition's per-channel range (0 where the range is 0)."""
    heads, length, dim = states.shape
    parts = states.view(heads, length // lag_size, lag_size, dim)
    target, reference = parts[:, :-1], parts[:, 1:]
    low = reference.amin(dim=2, keepdim=True)
    span = reference.amax(dim=2, keepdim=True) - low
    normalised = torch.where(span > 0, (target - low) / span.clamp(min=torch.finfo(span.dtype).tiny),
                             torch.zeros_like(target))
    return normalised.std(dim=-1).softmax(dim=-1)
