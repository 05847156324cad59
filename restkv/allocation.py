"""How many tokens each row, layer and KV head keeps.

The uniform allocation gives every KV head of every layer the row's budget. Head- and
layer-adaptive allocations (PyramidKV, AdaKV, HeadKV) return ragged counts through the
same function, and the cache stores them ragged.
"""

from __future__ import annotations

import torch

from restkv.policies.base import ScoringContext


def allocate(ctx: ScoringContext, scores: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv]`` tokens kept per row and KV head, protected tokens included."""
    return uniform(ctx)


def uniform(ctx: ScoringContext) -> torch.Tensor:
    """Every KV head keeps the row budget."""
    return ctx.budgets[:, None].expand(-1, ctx.num_kv_heads).clone()
