"""CAPKV (arXiv 2604.25975): the tokens the expected queries read whose values the others cannot replace.

A token's relevance is ``w_i = exp(tau cos(a, k_i) - max)``, ``a`` the mean of the prompt's
queries turned to the positions to come (``restkv.policies.future_queries``), ``tau`` =
``--cap_tau``; its capacity is the leverage of its value among the relevance-weighted values,
``v_i^T A^-1 v_i`` with ``A = I + sum_j (w_j + eps) v_j v_j^T`` (``eps`` = ``--cap_epsilon``,
a float32 solve per query head). The score ``w_i v_i^T A^-1 v_i``, averaged over the query group,
keeps what is read and not redundant.

As kvpress' ``CapPress``: keys and anchor are compared by their cosine (the paper's dot product
overflows), with the anchor rotated by the mean future RoPE (not in the paper). Where this
differs: the recent ``--window_size`` tokens are kept as for every restkv scorer (kvpress
protects only the sinks: ``--window_size 0`` reproduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.config.options import option, register
from restkv.policies.future_queries import FutureQueries


@register("method")
@dataclass(frozen=True)
class CAPKV(FutureQueries):
    name = "capkv"
    reference = "CAPKV: arXiv 2604.25975"

    cap_tau: float = option(5.0, "CAPKV: temperature of the anchor-key cosine in the relevance weights", minimum=0)
    cap_epsilon: float = option(1e-6, "CAPKV: added to each relevance weight in the capacity matrix", minimum=0)

    def future_scores(self, ctx, queries, keys, values, rotation):
        groups = queries.shape[0] // keys.shape[0]
        anchor = queries.mean(dim=1) @ rotation.T  # [H, d]
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        cosine = (F.normalize(keys, dim=-1) @ F.normalize(anchor, dim=-1)[:, :, None]).squeeze(-1).clamp(-1, 1)
        logits = self.cap_tau * cosine
        weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # [H, n]
        scaled = values * (weights + self.cap_epsilon).sqrt()[..., None]
        capacity = torch.eye(values.shape[-1], device=values.device) + scaled.transpose(1, 2) @ scaled
        solved = torch.linalg.solve(capacity, values.transpose(1, 2))  # A^-1 v, [H, d, n]
        leverage = (values.transpose(1, 2) * solved).sum(dim=1)
        return ctx.reduce_groups((weights * leverage)[None], self.gqa_score_agg)[0]
