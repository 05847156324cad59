"""``--merge pivot`` (LOOK-M style): every evicted token is averaged into the kept token whose key is
most similar (cosine); keys and values move together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.config.options import Options, register
from restkv.merges.evicted import evicted_mask
from restkv.pipeline.inputs import LayerInputs

#: query positions per block when matching evicted keys to pivots (bounds the similarity matrix)
PIVOT_BLOCK = 1024


@register("merge")
@dataclass(frozen=True)
class PivotMerge(Options):
    """``--merge pivot``: LOOK-M's pivot merge after any scorer's selection."""

    name = "pivot"
    reference = "LOOK-M's pivotal merging: Wan et al., 2024, arXiv 2406.18139"

    def merge(
        self, ctx: LayerInputs, columns: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return pivot_merge(ctx.key, ctx.value, evicted_mask(ctx.visible, columns), columns, keys, values)


def pivot_merge(
    key: torch.Tensor,
    value: torch.Tensor,
    evicted: torch.Tensor,
    columns: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LOOK-M pivot merge.

    Parameters
    ----------
    key, value: ``[B, H_kv, N, d]`` the layer's full prompt K/V.
    evicted: ``[B, H_kv, N]`` bool, tokens to merge.
    columns: ``[B, H_kv, K]`` kept columns (ascending; -1 = unused slot).
    keys, values: ``[B, H_kv, K, d]`` the kept entries.

    Each evicted ``e`` picks the pivot ``r = argmax_kept cos(k_e, k_r)`` (ties: the lowest
    position); then ``k_r <- (k_r + sum_e (k_e + k_r) / 2) / (1 + n_r)`` and the same for ``v``
    with the same assignment. Returns the merged ``(keys, values)`` in their dtype.
    """
    if not bool(evicted.any()):
        return keys, values
    pivots, _ = nearest_kept(key, columns, keys)
    weight = evicted.float()
    counts = torch.zeros(columns.shape, dtype=torch.float32, device=key.device).scatter_add_(2, pivots, weight)

    def merged(kept: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        index = pivots[..., None].expand(*pivots.shape, full.shape[-1])
        sums = torch.zeros(kept.shape, dtype=torch.float32, device=kept.device)
        sums.scatter_add_(2, index, full.float() * weight[..., None])
        n = counts[..., None]
        return ((kept.float() * (1.0 + n / 2.0) + sums / 2.0) / (1.0 + n)).to(kept.dtype)

    return merged(keys, key), merged(values, value)


def nearest_kept(key: torch.Tensor, columns: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every token of ``key`` ``[B, H_kv, N, d]``: the slot of the kept key (``keys`` ``[B, H_kv,
    K, d]`` at ``columns``, -1 unused) most cosine-similar to it (ties: the first slot, the lowest
    position), and that cosine; each ``[B, H_kv, N]``, in blocks of ``PIVOT_BLOCK`` tokens."""
    slot_valid = columns >= 0
    kept_directions = F.normalize(keys.float(), dim=-1)
    length = key.shape[2]
    slots = torch.empty(key.shape[:3], dtype=torch.long, device=key.device)
    best = torch.empty(key.shape[:3], dtype=torch.float32, device=key.device)
    for start in range(0, length, PIVOT_BLOCK):
        block = slice(start, min(start + PIVOT_BLOCK, length))
        similarity = torch.matmul(F.normalize(key[:, :, block].float(), dim=-1), kept_directions.transpose(-1, -2))
        similarity = similarity.masked_fill(~slot_valid[:, :, None, :], float("-inf"))
        best[:, :, block], slots[:, :, block] = similarity.max(dim=-1)
    return slots, best
