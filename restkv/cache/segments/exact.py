"""The exact-token segments of a set of kept tokens: dense, or ragged when the dense layout would
waste more than ``RAGGED_WASTE`` of its slots; and every exact token of a layer as one padded view."""

from __future__ import annotations

import torch

from restkv.cache.segments.base import RAGGED_WASTE
from restkv.cache.segments.dense import DenseTokens
from restkv.cache.segments.ragged import RaggedTokens


def exact_tokens(keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 capacity: int | None = None) -> DenseTokens | RaggedTokens:
    """The segment that holds kept tokens ``[B, H_kv, S, d]`` at ``columns`` (-1 = unused slot):
    ragged when the dense layout would leave more than ``RAGGED_WASTE`` of its slots empty."""
    slots = columns.numel()
    used = int((columns >= 0).sum())
    if slots and used < (1.0 - RAGGED_WASTE) * slots:
        return RaggedTokens(keys, values, columns, capacity)
    return DenseTokens(keys, values, columns, capacity)


def joined_view(segments: list, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every exact token of ``segments`` as one padded view ``(keys, values, columns)``
    ``[B, H_kv, S, d]``: each head's tokens first, in the segments' order (ascending positions),
    then unused slots (column -1); ``appended``: with the tokens appended since compression."""
    views = [segment.padded(appended) for segment in segments]
    keys = torch.cat([view[0] for view in views], dim=2)
    values = torch.cat([view[1] for view in views], dim=2)
    columns = torch.cat([view[2].to(torch.int32) for view in views], dim=2)
    order = torch.sort((columns < 0).to(torch.int8), dim=-1, stable=True).indices  # held slots first, in order
    width = int((columns >= 0).sum(dim=-1).max()) if columns.numel() else 0
    order = order[..., :width]
    columns = columns.gather(2, order)
    held = (columns >= 0)[..., None]
    keys = keys.gather(2, order[..., None].expand(-1, -1, -1, keys.shape[-1])).masked_fill(~held, 0)
    values = values.gather(2, order[..., None].expand(-1, -1, -1, values.shape[-1])).masked_fill(~held, 0)
    return keys, values, columns
