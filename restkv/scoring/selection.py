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
from typing import Any, NamedTuple

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


def descending_ranks(values: torch.Tensor) -> torch.Tensor:
    """``values``' shape, long: each entry's place in a stable descending sort of its last
    dimension (0: the largest; ties keep their order), so ``ranks < k`` marks each row's top ``k``."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def gather_columns(tensor: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Gather ``[B, H_kv, N, d]`` at ``[B, H_kv, K]`` column indices; -1 slots become zeros."""
    safe = columns.clamp(min=0)
    picked = tensor.gather(2, safe[..., None].expand(*safe.shape, tensor.shape[-1]))
    return picked.masked_fill((columns < 0)[..., None], 0)


class Reservation(NamedTuple):
    """What a part that keeps a summary of the tokens it evicts (ResKV's entries, MomentKV's
    statistics, IndexMem's memory) makes of a layer's scores and budgets before selection:
    the scores to rank by, the exact tokens each head keeps ``[B, H_kv]`` once the summary has
    its slots, and what the part remembers for ``summarise``."""

    scores: torch.Tensor
    keep: torch.Tensor
    memo: Any = None
