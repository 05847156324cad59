"""MomentKV (Li, Li, Lan, arXiv 2606.01563): moment statistics of the evicted tokens.

``--moments`` (on any scorer whose ranking can be split) keeps, per row, layer and KV head,
the count ``n``, key mean ``mu_k``, value mean ``mu_v`` and value-key covariance
``C = (1/n) sum_E (v - mu_v)(k - mu_k)^T`` of the evicted set ``E``. ``--method momentkv`` is
SnapKV's scorer with ``--moments``.

**Normalisation-corrected readout**: expanding
``exp(s <q, k>)`` to first order around ``mu_k`` and summing over ``E`` gives
``Z_E = n exp(s <q, mu_k>)`` and ``N_E = Z_E (mu_v + s C q)``, so the evicted tokens become one
extra softmax entry with key ``mu_k``, log-mass ``log n`` and the query-dependent value
``mu_v + s C q``, read in the same softmax as the kept tokens (decode steps and question chunks,
``MomentEntry``, a summary segment of the compressed layer). Exact when every evicted key is the same. ``--moments_outside_softmax``
(ablation) normalises the estimate on its own and mixes it in with weight ``n / (n + |M|)``
(ResKV's separate-softmax form); ``--no-moments_covariance`` drops ``C`` (then the entry is a
one-cluster ResKV entry without gate).

**Moment-informed eviction** (the paper's form as its readers report it; its vector and subspace
were not recovered): a token's score becomes ``score x ||x_j - P_S x_j||``, its residual norm
against a summary subspace ``S`` of the evicted set, so tokens the summary already represents
are evicted first and the evicted set stays regular. The summary is that of a tentative
eviction by the base scores (one shot at prefill, there is no running summary yet).
``x`` is the key (``--moments_vector``, or the value); ``S`` is the span of the evicted mean
(``--moments_subspace mean``) or of the top ``--moments_rank`` principal directions of the
evicted vectors' second moment (``principal``). Scores with negative candidates are shifted by
their row's smallest candidate score first, so the product keeps their order's sense.
``--moments_no_mi`` (ablation) keeps the base selection.

**Budget**: the statistics count against the budget in token slots (one slot = a key and a
value, ``2 d`` numbers): the entry takes one slot and ``C`` (``d^2`` numbers) ``ceil(d / 2)``,
so a head that evicts keeps ``budget - 1 - ceil(d / 2)`` exact tokens (33 slots at ``d = 64``,
65 at ``d = 128``); ``--moments_free_stats`` keeps the full budget of exact tokens and stores the
statistics on top. ``cache_report`` shows the entry (``residual``) and ``C`` (``stats``). Heads
that evict nothing store nothing extra, and a head whose budget cannot hold the statistics
besides its protected tokens (a small layer of a pyramid) evicts as the base method does.

Statistics are built once per compression; chunked prefill and decode-time compression
(which would merge them online) are not supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restkv.cache.segments.moment_entry import MomentEntry
from restkv.config.options import ConfigError, Options, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.scoring.selection import Reservation, rank_keys, select_columns

MOMENT_VECTORS = ("key", "value")


MOMENT_SUBSPACES = ("mean", "principal")


@register("switch")
@dataclass(frozen=True)
class Moments(Options):
    """MomentKV: moment statistics of the evicted tokens, read as one first-order softmax entry."""

    name = "moments"
    reference = "MomentKV: Li, Li and Lan, arXiv 2606.01563"
    switch_help = ("MomentKV: keep the evicted tokens' count, means and value-key covariance and read them as one "
                   "first-order softmax entry (its slots come from the budget)")

    moments_no_mi: bool = option(False, "MomentKV ablation: no moment-informed eviction (the base scores select)")
    moments_outside_softmax: bool = option(
        False, "MomentKV ablation: normalise the evicted estimate on its own and mix it in with weight n / (n + |M|) "
        "instead of one shared softmax"
    )
    moments_covariance: bool = option(
        True, "MomentKV: keep the value-key covariance (the query-dependent first-order value term)"
    )
    moments_free_stats: bool = option(
        False, "MomentKV: store the statistics on top of the budget instead of taking their slots from it"
    )
    moments_vector: str = option("key", "MomentKV eviction: the vector whose residual against the summary ranks",
                                 MOMENT_VECTORS)
    moments_subspace: str = option(
        "mean", "MomentKV eviction: the summary subspace: the evicted mean's direction, or the top principal "
        "directions of the evicted vectors", MOMENT_SUBSPACES,
    )
    moments_rank: int = option(4, "MomentKV eviction: principal directions in --moments_subspace principal",
                               minimum=1)

    def check(self, config) -> None:
        policy = config.policy
        if not policy.evicts:
            raise ConfigError(f"--moments summarises evicted tokens; --method {policy.name} evicts nothing")
        if config.switch("residual") is not None:
            raise ConfigError("--moments and --residual both summarise the evicted tokens in the last slots; use one")
        if config.merger is not None:
            merging = config.chosen_by(config.merger)
            raise ConfigError(f"--moments summarises the evicted tokens as they are; {merging} merges them into the "
                              "kept entries (they would count twice)")
        if policy.ranks_by_position and not self.moments_no_mi:
            raise ConfigError(f"--method {policy.name} keeps tokens by position; moment-informed eviction rescales "
                              "scores, so use it with --moments_no_mi")
        if config.rescores and config.allocator.head_adaptive:
            raise ConfigError(f"--moments with {' and '.join(config.rescoring_flags())} merges each head's statistics "
                              f"as tokens come; --allocation {config.run.allocation} gives heads their own budgets "
                              "(not supported together: use a uniform or layer-wise allocation)")

    def slots(self, head_dim: int) -> int:
        """Token slots the statistics of one KV head cost: the entry, and ``C`` in ``2 d``-number slots."""
        return 1 + (math.ceil(head_dim / 2) if self.moments_covariance else 0)

    def reserve(self, ctx: LayerInputs, scores: torch.Tensor, keep: torch.Tensor, previous=()) -> Reservation:
        """The statistics take their slots (``keep`` less their cost on the heads that keep them:
        those that evict and whose budget holds the statistics besides the protected tokens; the
        others evict as the base method does), and moment-informed eviction rescores. A head that
        already holds an entry (``previous``: a layer compressed again, whose budget its slots
        already lowered) keeps it, and what it evicts now is merged in (``summarise``)."""
        old = next((segment for segment in previous if isinstance(segment, MomentEntry)), None)
        held = torch.zeros_like(keep, dtype=torch.bool) if old is None else old.counts().to(keep.device) > 0
        cost = 0 if self.moments_free_stats else self.slots(ctx.key.shape[-1])
        protected = ctx.protected.sum(dim=-1)[:, None]
        evicts = (keep < ctx.visible.sum(dim=-1)[:, None]) & (held | (keep - cost >= protected))
        keep = torch.where(evicts & ~held, keep - cost, keep)
        memo = (evicts | held, old)
        if self.moments_no_mi or not bool(evicts.any()):
            return Reservation(scores, keep, memo)
        tentative = _evicted(ctx, select_columns(rank_keys(scores, ctx.visible, ctx.protected, ctx.layer_idx), keep))
        vectors = (ctx.key if self.moments_vector == "key" else ctx.value).float()
        residual = _residual_norms(vectors, tentative, self.moments_subspace, self.moments_rank)
        candidates = ctx.candidates[:, None, :] & evicts[..., None]
        finite = candidates & torch.isfinite(scores)
        floor = scores.float().masked_fill(~finite, float("inf")).amin(dim=-1, keepdim=True).clamp(max=0)
        rescored = torch.where(candidates, (scores.float() - floor) * residual, scores.float())
        return Reservation(rescored, keep, memo)

    def summarise(self, ctx: LayerInputs, columns: torch.Tensor, memo) -> list:
        """The evicted set's ``MomentEntry`` on the heads that keep statistics (none if none of them
        evicted anything), merged with the entry they held before (``merged_with``)."""
        summarised, old = memo
        fresh = self._entry(ctx, _evicted(ctx, columns) & summarised[..., None])
        if old is None or fresh is None:
            return [entry for entry in (fresh, old) if entry is not None]
        return [fresh.merged_with(old)]

    def _entry(self, ctx: LayerInputs, evicted: torch.Tensor) -> "MomentEntry | None":
        """The ``MomentEntry`` of the ``evicted`` ``[B, H_kv, N]`` tokens, or None if there are none."""
        counts = evicted.sum(dim=-1)  # [B, H_kv]
        if not bool(counts.any()):
            return None
        weights = evicted.float()[..., None]
        total = counts.clamp(min=1).float()[..., None]
        keys, values = ctx.key.float(), ctx.value.float()
        key_mean = (keys * weights).sum(dim=2) / total
        value_mean = (values * weights).sum(dim=2) / total
        length = evicted.shape[-1]
        first = torch.where(evicted, torch.arange(length, device=evicted.device), length).amin(dim=-1)
        covariance = None
        if self.moments_covariance:
            centred_keys = (keys - key_mean[:, :, None]) * weights
            centred_values = (values - value_mean[:, :, None]) * weights
            covariance = torch.einsum("bknv,bknd->bkvd", centred_values, centred_keys) / total[..., None]
        log_count = torch.where(counts > 0, counts.float().log(), float("-inf"))
        oldest = ctx.positions_of(torch.where(counts > 0, first, -1)[..., None])[..., 0]
        cost = 0 if self.moments_free_stats else self.slots(ctx.key.shape[-1])
        return MomentEntry(key_mean.to(ctx.key.dtype), value_mean.to(ctx.value.dtype), log_count,
                           None if covariance is None else covariance.to(ctx.value.dtype), oldest,
                           self.moments_outside_softmax, cost)


def _evicted(ctx: LayerInputs, columns: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: visible tokens that ``columns`` (``[B, H_kv, K]``, -1 unused) does not keep."""
    batch, heads = columns.shape[:2]
    kept = torch.zeros(batch, heads, ctx.key.shape[2] + 1, dtype=torch.bool, device=columns.device)
    kept.scatter_(2, torch.where(columns >= 0, columns, ctx.key.shape[2]).long(), True)
    return ctx.visible[:, None, :] & ~kept[..., :-1]


def _residual_norms(vectors: torch.Tensor, evicted: torch.Tensor, subspace: str, rank: int) -> torch.Tensor:
    """``[B, H_kv, N]`` ``||x - P_S x||`` of every vector ``[B, H_kv, N, d]`` against the summary
    subspace of its head's evicted ones (one row at a time, so rows do not depend on each other)."""
    norms = []
    for row in range(vectors.shape[0]):
        x, members = vectors[row], evicted[row].float()[..., None]  # [H_kv, N, d], [H_kv, N, 1]
        count = members.sum(dim=1).clamp(min=1)  # [H_kv, 1]
        if subspace == "mean":
            direction = (x * members).sum(dim=1) / count
            basis = (direction / direction.norm(dim=-1, keepdim=True).clamp(min=1e-12))[..., None]  # [H_kv, d, 1]
        else:
            second = torch.einsum("knd,kne->kde", x * members, x) / count[..., None]
            basis = torch.linalg.eigh(second).eigenvectors[..., -min(rank, x.shape[-1]):]  # [H_kv, d, r]
        projected = (x @ basis) @ basis.transpose(-1, -2)
        norms.append((x - projected).norm(dim=-1))
    return torch.stack(norms)
