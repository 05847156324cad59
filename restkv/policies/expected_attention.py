"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636): the attention future queries are expected to pay.

The prompt's queries model the queries to come (``restkv.policies.future_queries``): their
pre-RoPE mean ``mu`` and covariance ``S`` make a future query Gaussian; rotated by the mean
future rotation ``R``, the expected softmax numerator of key ``k`` is
``exp(s k.R mu + s^2/2 k^T R S R^T k)`` (the Gaussian's moment generating function at ``s k``,
``s`` the layer's attention scale). A token's score is that expected attention, normalised
over the row's tokens after the sinks, averaged over the query group (``--gqa_score_agg``)
and, with ``--ea_vnorm``, multiplied by ``(score + --ea_epsilon) * ||v||`` (what the token adds
to the output, not only how much it is read). ``--no-ea_covariance`` drops the second-order term.

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
from restkv.options import option, register
from restkv.policies.future_queries import FutureQueries


@register("method")
@dataclass(frozen=True)
class ExpectedAttention(FutureQueries):
    name = "expected_attention"

    ea_covariance: bool = option(True, "Expected Attention: add the query covariance's second-order term")
    ea_vnorm: bool = option(True, "Expected Attention: weight each score by its value's norm")
    ea_epsilon: float = option(0.0, "Expected Attention: added to each score before the value-norm weighting",
                               minimum=0)

    def future_scores(self, ctx, queries, keys, values, rotation):
        scores = self.expected_attention(ctx, queries, keys, rotation)
        return (scores + self.ea_epsilon) * values.norm(dim=-1) if self.ea_vnorm else scores

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
