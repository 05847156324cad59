"""Ranking and top-k selection shared by every policy (and the residual cache).

Protected tokens rank first, then candidates by score, ties to the lower position (stable
sort); tokens that do not compete (padding, tokens a sliding window no longer shows) rank
last and are never kept in place of a competing token. A non-finite score (NaN, or an
infinity from an overflowing fp16 key) ranks below every finite one, so it can never
displace a protected token; a warning names the layer. Kept tokens are returned in
ascending position order. Columns index the padded batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch


def rank_keys(scores: torch.Tensor, visible: torch.Tensor, protected: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
    """``[B, H_kv, N]`` float32 ranking keys: ``+inf`` protected, the score for a competing token
    (non-finite scores at the lowest finite value), ``-inf`` for tokens that do not compete."""
    ranked = scores.float()
    competing = visible[:, None, :] & ~protected[:, None, :]
    broken = competing & ~torch.isfinite(ranked)
    if bool(broken.any()):
        warnings.warn(
            f"restkv: layer {layer_idx} produced {int(broken.sum())} non-finite scores (NaN or inf); they rank "
            "below every finite score and never displace protected tokens",
            RuntimeWarning,
            stacklevel=2,
        )
        ranked = ranked.masked_fill(broken, torch.finfo(torch.float32).min)
    ranked = ranked.masked_fill(protected[:, None, :], float("inf"))
    return ranked.masked_fill(~visible[:, None, :], float("-inf"))


def select_columns(ranked: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Choose which columns each (row, KV head) keeps.

    Parameters
    ----------
    ranked: ``[B, H_kv, N]`` ranking keys from ``rank_keys``.
    keep: ``[B, H_kv]`` int, tokens to keep per row and head (protected ones included).

    Returns
    -------
    ``[B, H_kv, K]`` long column indices in ascending order, ``K = keep.max()``; slots
    beyond a head's ``keep`` hold -1.
    """
    length = ranked.shape[-1]
    width = int(keep.max().item()) if keep.numel() else 0
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
    slot = torch.arange(width, device=ranked.device)
    in_budget = slot < keep[..., None]
    # Push unused slots past every real column, sort, then mark them -1.
    columns = torch.where(in_budget, order, torch.full_like(order, length)).sort(dim=-1).values
    return columns.masked_fill(columns == length, -1)


def gather_columns(tensor: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Gather ``[B, H_kv, N, d]`` at ``[B, H_kv, K]`` column indices; -1 slots become zeros."""
    safe = columns.clamp(min=0)
    picked = tensor.gather(2, safe[..., None].expand(*safe.shape, tensor.shape[-1]))
    return picked.masked_fill((columns < 0)[..., None], 0)


@dataclass(frozen=True)
class Selection:
    """What one layer keeps after compression (padded-batch columns).

    keys, values: ``[B, H_kv, S, d]``. Each head's kept prompt tokens fill its first slots in
    ascending position order; with residual entries (ResKV) those fill its last slots; slots
    in between are unused (zeros).
    columns: ``[B, H_kv, S]`` padded-batch column of each kept token; -1 in residual and unused slots.
    residual_log_counts: ``[B, H_kv, R]`` float32 ``log c`` of the entry in each of the last ``R``
        slots, ``-inf`` where that slot holds none; None when no head of the layer has one.
    residual_columns: ``[B, H_kv, R]`` padded-batch column of each entry's oldest member (-1
        where no entry); None likewise.
    output_correction: what the layer adds to its attention output for the evicted tokens
        (``restkv.cache.OutputCorrection``, from ``Policy.summarise``); None for most methods.
    residual_value_maps: ``[B, H_kv, M, d, d]`` query-dependent value terms of the last ``M``
        slots (``restkv.cache.Segment.value_maps``; MomentKV); None without them.
    key_channels: ``[B, H_kv, c]`` ascending key channels each head keeps (ThinK,
        ``restkv.channel_pruning``: the others are zero in ``keys`` outside the recent tokens);
        None when every channel is kept.
    """

    keys: torch.Tensor
    values: torch.Tensor
    columns: torch.Tensor
    residual_log_counts: torch.Tensor | None = None
    residual_columns: torch.Tensor | None = None
    output_correction: Any = None
    residual_value_maps: torch.Tensor | None = None
    key_channels: torch.Tensor | None = None
