"""What a selection kept and evicted, per row and KV head: the masks every merge folds evicted
tokens by. Padding-aware (left padding: ``columns`` index the padded batch) and ragged
(``columns == -1`` marks unused slots)."""

from __future__ import annotations

import torch


def kept_mask(columns: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: which columns each (row, KV head) keeps."""
    batch, heads, _ = columns.shape
    mask = torch.zeros(batch, heads, length + 1, dtype=torch.bool, device=columns.device)
    mask.scatter_(2, columns.masked_fill(columns < 0, length), True)
    return mask[..., :length]


def evicted_mask(visible: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, N]`` bool: visible tokens (``[B, N]``) a head did not keep."""
    return visible[:, None, :] & ~kept_mask(columns, visible.shape[-1])
