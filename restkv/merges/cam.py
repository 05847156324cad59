"""CaM's value merging (``--method cam``): ``cam_merge`` (the paper's semantics: each evicted value is
spread over the next ``m`` kept values with a probability given by its attention relative to
theirs; keys untouched) and ``cam_reference_values`` (the original release's sequential forward
cascade over the whole prompt, before selection)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


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
