"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636): the attention future queries are expected to pay.

The queries that will read the cache (the answer's) do not exist at compression time; the
prompt's own queries stand for them. Their pre-RoPE mean ``mu`` and covariance ``S`` (over the
row's tokens after the ``--n_sink`` sinks) model a future query as Gaussian; rotated by ``R``,
the mean RoPE rotation of the ``--ea_future_positions`` positions after the prompt, the expected
softmax numerator of key ``k`` is ``exp(s k.R mu + s^2/2 k^T R S R^T k)`` (the Gaussian's moment
generating function at ``s k``, ``s`` the layer's attention scale). A token's score is that
expected attention, normalised over the row's tokens after the sinks, averaged over the query
group (``--gqa_score_agg``) and, with ``--ea_vnorm``, multiplied by ``(score + --ea_epsilon) *
||v||`` (what the token adds to the output, not only how much it is read). The sinks score
above every other token. ``--ea_covariance false`` drops the second-order term.

``R`` comes from the rotation the prompt's own positions were given (``restkv.rope``), so any
RoPE scaling transformers applies is followed; a layer without RoPE tables (``compress_kv``
without ``rotary``) is refused. The statistics need every prompt query of the layer at once: a
reconstruction observation, a model-wide allocation, chunked prefill and decode budgets (which
see a window of queries or none) are refused in one line.

Where this differs from kvpress' ``ExpectedAttentionPress``: the statistics are those of each
row's own tokens (kvpress' cover every column of the batch, the same for batch size 1);
``s`` is the layer's own scale (kvpress' ``1/sqrt(d)``, the same for every family but Gemma's
``query_pre_attn_scalar``); the recent ``--window_size`` tokens are kept as for every restkv
scorer (kvpress protects only the sinks: ``--window_size 0`` reproduces it); soft-capping is
not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.context import ScoringContext
from restkv.options import ConfigError, option, register
from restkv.policies.base import GroupedScores, KeepsSinks
from restkv.policies.row_local import score_rows
from restkv.rope import following_rotation, rotation_matrix, unrotate


@register("method")
@dataclass(frozen=True)
class ExpectedAttention(KeepsSinks, GroupedScores):
    name = "expected_attention"
    needs_rotary = True

    ea_future_positions: int = option(
        512, "Expected Attention: positions after the prompt whose mean RoPE rotation turns the query statistics",
        minimum=1)
    ea_covariance: bool = option(True, "Expected Attention: add the query covariance's second-order term")
    ea_vnorm: bool = option(True, "Expected Attention: weight each score by its value's norm")
    ea_epsilon: float = option(0.0, "Expected Attention: added to each score before the value-norm weighting",
                               minimum=0)

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)
        flags = []
        if config.compresses_after_prefill:
            flags += config.deferring_flags()
        if config.rescores:
            flags += config.rescoring_flags()
        if flags:
            raise ConfigError(f"--method {self.name} models future queries by every prompt query of a layer at once; "
                              f"{' and '.join(flags)} leave{'s' if len(flags) == 1 else ''} it a window of them or "
                              "none")

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        if ctx.query.shape[2] != ctx.key.shape[2]:
            raise ValueError(f"--method {self.name} reads every prompt query: give as many queries as keys")
        cos, sin = ctx.rotary
        lengths = ctx.plan.lengths.tolist()

        def row_scores(row: int, columns: slice) -> torch.Tensor:
            count = columns.stop - columns.start
            sinks = max(self.n_sink - (int(lengths[row]) - count), 0)  # the row's first tokens among these
            row_cos, row_sin = cos[row, columns], sin[row, columns]
            queries = unrotate(ctx.query[row : row + 1, :, columns], row_cos[None], row_sin[None])[0].float()
            rotation = rotation_matrix(*following_rotation(row_cos, row_sin, self.ea_future_positions)).float()
            scores = self.expected_attention(ctx, queries[:, sinks:], ctx.key[row, :, columns][:, sinks:].float(),
                                             rotation)
            if self.ea_vnorm:
                scores = (scores + self.ea_epsilon) * ctx.value[row, :, columns][:, sinks:].float().norm(dim=-1)
            full = torch.empty(scores.shape[0], count, dtype=torch.float32, device=scores.device)
            full[:, sinks:] = scores
            full[:, :sinks] = scores.max() + 1 if scores.numel() else 1.0
            return full

        return score_rows(ctx, row_scores)

    def expected_attention(self, ctx: ScoringContext, queries: torch.Tensor, keys: torch.Tensor,
                           rotation: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` the normalised expected attention of ``keys`` ``[H_kv, n, d]`` (post-RoPE)
        under future queries distributed as ``queries`` ``[H, n, d]`` (pre-RoPE), turned by ``rotation``."""
        mean = queries.mean(dim=1)  # [H, d]
        groups = queries.shape[0] // keys.shape[0]
        keys = keys.repeat_interleave(groups, dim=0)  # [H, n, d]
        logits = ctx.scaling * keys @ (mean @ rotation.T)[:, :, None]
        if self.ea_covariance:
            centred = queries - mean[:, None]
            covariance = rotation @ (centred.transpose(1, 2) @ centred / queries.shape[1]) @ rotation.T
            logits = logits + ctx.scaling**2 / 2 * ((keys @ covariance) * keys).sum(dim=-1, keepdim=True)
        weights = logits.squeeze(-1).softmax(dim=-1)  # [H, n]
        return ctx.reduce_groups(weights[None], self.gqa_score_agg)[0]
