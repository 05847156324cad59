"""``--merge cam``, CaM's value merging (Zhang et al., ICML 2024; the merge ``--method cam`` is defined
with): every evicted value is spread over the next kept values with a probability given by its attention
relative to theirs, keys untouched (``cam_merge``, the paper's semantics), or the original release's
sequential forward cascade over the whole prompt (``cam_reference_values``).

In the paper mode every evicted value is added to the next ``--cam_merge_tokens`` kept values with
probability ``min(1, a_e / mean a_T)`` (``a`` = the observation queries' mean attention, reduced to a
KV head by ``--gqa_score_agg``), drawn from a generator seeded with ``--cam_seed`` (or in expectation
with ``--cam_expected``). Draws are made per row in row-local order, so a row of a left-padded batch
merges exactly as it does alone. The budget is the scorer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.config.options import ConfigError, Options, option, redeclared, register
from restkv.merges.evicted import evicted_mask
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores
from restkv.scoring.selection import gather_columns

CAM_MODES = ("paper", "reference")


@register("merge")
@dataclass(frozen=True)
class CaMMerge(Options):
    """``--merge cam``: CaM's merge of evicted values into the kept ones after any query scorer's selection."""

    name = "cam"
    reference = "CaM (cache merging): Zhang et al., ICML 2024"

    gqa_score_agg: str = redeclared(GroupedScores, "gqa_score_agg", "mean")
    cam_mode: str = option("paper", "CaM: the paper's merge after selection, or the release's cascade", CAM_MODES)
    cam_seed: int = option(0, "CaM: seed of the Bernoulli merge decisions", minimum=0)
    cam_expected: bool = option(False, "CaM: merge with the probability itself instead of a Bernoulli draw")
    cam_merge_tokens: int = option(32, "CaM (paper mode): kept tokens after an evicted one that share its value",
                                   minimum=1)

    def check(self, config) -> None:
        if not config.policy.observes_queries:
            raise ConfigError(f"--merge cam weighs evicted values by the observation queries' attention; --method "
                              f"{config.policy.name} scores without queries")
        if self.cam_mode == "reference" and config.rescores:
            raise ConfigError("--cam_mode reference cascades over the whole prompt in one pass; with "
                              "--prefill_chunk_size or --decode_budget use --cam_mode paper")

    def merge(
        self, ctx: LayerInputs, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mean_attention = ctx.reduce_groups(ctx.observation.mean(), self.gqa_score_agg)
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


def cam_merge(
    value: torch.Tensor,
    evicted: torch.Tensor,
    columns: torch.Tensor,
    values: torch.Tensor,
    mean_attention: torch.Tensor,
    merge_tokens: int,
    draws: torch.Tensor | None,
) -> torch.Tensor:
    """CaM, paper semantics: merge each evicted value into the next kept ones.

    Parameters
    ----------
    value: ``[B, H_kv, N, d]`` the layer's original prompt values (no cascade).
    evicted: ``[B, H_kv, N]`` bool.
    columns, values: ``[B, H_kv, K]`` kept columns (ascending, -1 unused) and their values.
    mean_attention: ``[B, H_kv, N]`` window-mean attention ``a`` per KV head.
    merge_tokens: ``m``; ``T_e`` = the first ``m`` kept positions after ``e``.
    draws: ``[B, H_kv, N]`` uniform numbers; ``z_e = draws_e < pi_e``. None merges with the
        expectation ``z_e = pi_e`` (``--cam_expected``).

    ``pi_e = clamp(a_e / mean_{t in T_e} a_t, 0, 1)`` (NaN -> 0, inf -> 1), and every
    ``t in T_e`` gets ``z_e v_e / |T_e|``. Returns the merged kept values.
    """
    length = value.shape[2]
    slot_valid = columns >= 0
    kept_count = slot_valid.sum(dim=-1, keepdim=True)
    padded_columns = columns.masked_fill(~slot_valid, length).contiguous()
    positions = torch.arange(length, device=value.device).expand(*evicted.shape).contiguous()
    first_after = torch.searchsorted(padded_columns, positions, right=True)  # slot of the first kept column > e
    targets = (kept_count - first_after).clamp(min=0, max=merge_tokens)
    kept_attention = mean_attention.gather(2, columns.clamp(min=0)).double().masked_fill(~slot_valid, 0.0)
    prefix = F.pad(kept_attention.cumsum(dim=-1), (1, 0))
    target_mean = (prefix.gather(2, first_after + targets) - prefix.gather(2, first_after)) / targets
    probability = torch.nan_to_num(mean_attention.double() / target_mean, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    merged = probability if draws is None else (draws.double() < probability).double()
    weight = torch.where(evicted & (targets > 0), merged / targets.clamp(min=1), torch.zeros_like(merged))
    # Evicted tokens between the same two kept tokens share their target range: sum them per
    # first slot, then every slot t receives the sums of the first slots in [t - m + 1, t].
    width = columns.shape[-1]
    per_first_slot = value.new_zeros(*columns.shape[:2], width + 1, value.shape[-1], dtype=torch.float64)
    index = first_after[..., None].expand(*first_after.shape, value.shape[-1])
    per_first_slot.scatter_add_(2, index, value.double() * weight[..., None])
    running = F.pad(per_first_slot[:, :, :width].cumsum(dim=2), (0, 0, 1, 0))
    lower = (torch.arange(width, device=value.device) + 1 - merge_tokens).clamp(min=0)
    received = running[:, :, 1:] - running[:, :, lower]
    received = received.masked_fill(~slot_valid[..., None], 0.0)
    return (values.double() + received).to(values.dtype)


def cam_reference_values(
    value: torch.Tensor, mean_attention: torch.Tensor, span: int, draws: torch.Tensor | None
) -> torch.Tensor:
    """The original release's CaM cascade over one row's real tokens.

    Parameters
    ----------
    value: ``[H_kv, L, d]`` the row's values; mean_attention ``[H_kv, L]`` window-mean attention.
    span: ``R = m``, the window size (the release merges over the window length).
    draws: ``[H_kv, L]`` uniform numbers, or None for the expectation.

    With ``start = ceil(0.1 L)``, for ``p = start .. L - R - 1`` in order:
    ``mu = max(max_{j < start} a_j, max_{p <= j < p + R} a_j)``,
    ``pi_p = clamp(a_p / mu, 0, 1)`` and ``v_{p+1 .. p+m} += z_p v_p / m`` (truncated at ``L``;
    ``v_p`` already holds earlier merges). Returns the merged ``[H_kv, L, d]`` values.
    """
    length = value.shape[1]
    start = math.ceil(0.1 * length)
    stop = length - span
    merged = value.double().clone()
    if stop <= start:
        return merged.to(value.dtype)
    attention = mean_attention.double()
    head_max = attention[:, :start].amax(dim=-1, keepdim=True)
    window_max = attention.unfold(-1, span, 1).amax(dim=-1)[:, start:stop]
    mu = torch.maximum(head_max, window_max)
    probability = torch.nan_to_num(attention[:, start:stop] / mu, nan=0.0, posinf=1.0).clamp(0.0, 1.0)
    if draws is not None:
        probability = (draws[:, start:stop].double() < probability).double()
    factors = probability / span
    for offset, p in enumerate(range(start, stop)):
        merged[:, p + 1 : p + 1 + span] += (factors[:, offset, None] * merged[:, p])[:, None, :]
    return merged.to(value.dtype)
