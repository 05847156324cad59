"""Top-k selection shared by every policy.

Ties go to the lower position (stable sort), kept tokens are returned in ascending
position order, and padding is never kept in place of a real token.
"""

from __future__ import annotations

import torch


def select_columns(
    scores: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Choose which columns each (row, KV head) keeps.

    Parameters
    ----------
    scores: ``[B, H_kv, N]`` float32 importance (read at candidate columns only).
    valid: ``[B, N]`` bool, real tokens.
    protected: ``[B, N]`` bool, always kept (must fit in ``keep``).
    keep: ``[B, H_kv]`` int, tokens to keep per row and head (protected ones included).

    Returns
    -------
    ``[B, H_kv, K]`` long column indices in ascending order, ``K = keep.max()``; slots
    beyond a head's ``keep`` hold -1.
    """
    length = scores.shape[-1]
    ranked = scores.float()
    ranked = ranked.masked_fill(protected[:, None, :], float("inf"))
    ranked = ranked.masked_fill(~valid[:, None, :], float("-inf"))
    width = int(keep.max().item()) if keep.numel() else 0
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
    slot = torch.arange(width, device=scores.device)
    in_budget = slot < keep[..., None]
    # Push unused slots past every real column, sort, then mark them -1.
    columns = torch.where(in_budget, order, torch.full_like(order, length)).sort(dim=-1).values
    return columns.masked_fill(columns == length, -1)


def gather_columns(tensor: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Gather ``[B, H_kv, N, d]`` at ``[B, H_kv, K]`` column indices; -1 slots become zeros."""
    safe = columns.clamp(min=0)
    picked = tensor.gather(2, safe[..., None].expand(*safe.shape, tensor.shape[-1]))
    return picked.masked_fill((columns < 0)[..., None], 0)
