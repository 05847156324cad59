"""``compress_kv``: the tensor-level entry point, used by the patched attention itself.

What a notebook gets from ``compress_kv`` is exactly what the model keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch

from restkv.allocation import allocate
from restkv.config import CompressionConfig, ConfigError
from restkv.merging import apply_merge
from restkv.policies import get_policy
from restkv.policies.base import ScoringContext
from restkv.residual import ResidualPlan, build_residual
from restkv.selection import gather_columns, select_columns


@dataclass(frozen=True)
class CompressedKV:
    """One layer's compressed K/V.

    keys, values: ``[B, H_kv, S, d]``. Each head's kept prompt tokens fill its first slots in
    ascending position order; with ``--residual`` its residual entries fill its last slots;
    slots in between are unused (zeros).
    indices: ``[B, H_kv, S]`` row-local prompt positions of the kept tokens (0 = the row's
    first real token); -1 in residual and unused slots.
    residual_log_counts: ``[B, H_kv, R]`` float32, ``log c`` (member count) of the entry in
    each of the last ``R`` slots, ``-inf`` where that slot holds no residual entry; None
    when no head of the layer has one.
    residual_positions: ``[B, H_kv, R]`` row-local position of each entry's oldest member
    (-1 where no entry); None likewise.

    Unpacks as ``keys, values, indices`` (what callers that ignore residual entries read).
    """

    keys: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    residual_log_counts: torch.Tensor | None = None
    residual_positions: torch.Tensor | None = None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.keys, self.values, self.indices))


def compress_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    config: CompressionConfig | Mapping[str, Any],
    layer_idx: int = 0,
    num_layers: int = 1,
    o_proj_weight: torch.Tensor | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> CompressedKV:
    """Compress one layer's prompt K/V with ``config.method``.

    Parameters
    ----------
    query: ``[B, H_q, N, d]`` post-RoPE queries of every prompt token (each policy takes
        the window it needs).
    key, value: ``[B, H_kv, N, d]``; ``H_q`` must be a multiple of ``H_kv`` (GQA: query
        head ``h`` reads KV head ``h // (H_q / H_kv)``).
    config: a ``CompressionConfig`` or a dict of its option names.
    layer_idx, num_layers: position of the layer (layer-dependent methods and budgets).
    o_proj_weight: ``[D, H_q * d]`` the layer's output projection (output-space scorers).
    attention_mask: optional ``[B, N]`` with 1 for real tokens, 0 for left padding.
    scaling: attention scale (default ``1/sqrt(d)``); softcap: logit soft-cap (Gemma 2).
    sliding_window: for sliding-window layers, keys older than the window are invisible.

    Returns
    -------
    ``CompressedKV`` (keys, values, indices, and with ``--residual`` the residual entries'
    log-counts and oldest positions). A row whose length does not exceed its budget keeps
    every real token.
    """
    config = CompressionConfig.from_any(config)
    valid = _validate_inputs(query, key, value, attention_mask)
    policy = get_policy(config.method)
    padding = (valid.shape[-1] - valid.sum(dim=-1))[:, None, None]
    visible, budgets = row_budgets(config, valid, sliding_window)
    protected_counts = [policy.protected_count(config, int(b)) for b in budgets.tolist()]
    _check_row_budgets(config, visible.sum(dim=-1).tolist(), budgets.tolist(), protected_counts)

    ctx = ScoringContext(
        query=query,
        key=key,
        value=value,
        valid=visible,
        budgets=budgets,
        protected=_recent_mask(visible, protected_counts),
        config=config,
        layer_idx=layer_idx,
        num_layers=num_layers,
        scaling=scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
        softcap=softcap,
        sliding_window=sliding_window,
        o_proj_weight=o_proj_weight,
    )
    residual = None
    if needs_compression(config, valid, layer_idx, sliding_window):
        scores = policy.score(ctx)
        keep = allocate(ctx, scores)
        if config.residual:
            residual = build_residual(ctx, scores, keep)
            keep = keep - residual.sizes
    else:
        scores = torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
        keep = ctx.lengths[:, None].expand(-1, key.shape[1])
    columns = select_columns(scores, visible, ctx.protected, keep)
    keys, values = policy.finalize(ctx, columns, gather_columns(key, columns), gather_columns(value, columns))
    keys, values = apply_merge(ctx, columns, keys, values)
    indices = torch.where(columns >= 0, columns - padding, columns)
    if residual is None or not bool(residual.sizes.any()):
        return CompressedKV(keys, values, indices)
    return _with_residual_entries(keys, values, indices, residual, keep, padding)


def _with_residual_entries(
    keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, plan: ResidualPlan, main: torch.Tensor,
    padding: torch.Tensor,
) -> CompressedKV:
    """Place each head's residual entries in its last slots; the layer stays ``max(m + r)``
    slots wide, the width the base method stores."""
    width = int((main + plan.sizes).max())
    grow = width - keys.shape[2]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, grow))
    values = torch.nn.functional.pad(values, (0, 0, 0, grow))
    indices = torch.nn.functional.pad(indices, (0, grow), value=-1)
    slots = plan.log_counts.shape[-1]
    reserved = torch.arange(slots, device=keys.device) >= slots - plan.sizes[..., None]  # [B, H_kv, R]
    keys[:, :, width - slots :] = torch.where(reserved[..., None], plan.keys, keys[:, :, width - slots :])
    values[:, :, width - slots :] = torch.where(reserved[..., None], plan.values, values[:, :, width - slots :])
    positions = torch.where(plan.first_columns >= 0, plan.first_columns - padding, -1)
    return CompressedKV(keys, values, indices, plan.log_counts, positions)


def row_budgets(
    config: CompressionConfig, valid: torch.Tensor, sliding_window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that compete for the budget and each row's budget.

    Returns ``visible`` ``[B, N]`` (real tokens the next query can still attend to: all of
    them, or on a sliding-window layer the last ``sliding_window - 1``) and ``budgets``
    ``[B]`` (the configured budget, never more than the visible tokens).
    """
    visible = valid
    if sliding_window is not None:
        length = valid.shape[-1]
        visible = valid & (torch.arange(length, device=valid.device) >= length - sliding_window + 1)
    lengths = valid.sum(dim=-1).tolist()
    counts = visible.sum(dim=-1).tolist()
    budgets = [min(config.budget_for(int(n)), int(c)) for n, c in zip(lengths, counts)]
    return visible, torch.tensor(budgets, device=valid.device)


def needs_compression(
    config: CompressionConfig, valid: torch.Tensor, layer_idx: int, sliding_window: int | None = None
) -> bool:
    """Whether any row of this layer holds more tokens than its budget.

    A sliding-window layer already holds at most ``sliding_window - 1`` prompt tokens, so it
    is compressed only when the budget is smaller than that.
    """
    if not get_policy(config.method).compresses_layer(config, layer_idx):
        return False
    visible, budgets = row_budgets(config, valid, sliding_window)
    return bool((budgets < visible.sum(dim=-1)).any())


def valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """``[B, N]`` bool real-token mask from an optional 2-D 0/1 mask; checks left padding."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must have shape [B, N] = [{batch}, {length}], got {list(attention_mask.shape)}")
    valid = attention_mask.to(device=device).bool()
    # Left padding: once a row has a real token, every later column is real.
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError(
            "restkv expects left padding (tokenizer.padding_side = 'left'); the attention mask has padding "
            "after a real token"
        )
    return valid


def _validate_inputs(query, key, value, attention_mask) -> torch.Tensor:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D: [B, H_q, N, d], [B, H_kv, N, d], [B, H_kv, N, d]")
    batch, num_heads, length, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must have the same shape")
    if key.shape[0] != batch or key.shape[2] != length or key.shape[-1] != head_dim:
        raise ValueError(f"query {list(query.shape)} and key {list(key.shape)} must agree on B, N and d")
    if num_heads % key.shape[1] != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({key.shape[1]})")
    if length == 0:
        raise ValueError("empty prompt: there is nothing to compress (N = 0)")
    valid = valid_from_mask(attention_mask, batch, length, key.device)
    if not bool(valid.any(dim=-1).all()):
        raise ValueError("a row of the batch is all padding; every row needs at least one real token")
    return valid


def _check_row_budgets(config, lengths, budgets, protected_counts) -> None:
    for length, budget, protected in zip(lengths, budgets, protected_counts):
        if length > budget and protected >= budget:
            raise ConfigError(
                f"a row of {length} tokens keeps {budget} tokens (--compression_ratio {config.compression_ratio}), "
                f"which does not exceed the {protected} protected tokens (--window_size {config.window_size}); "
                "lower the ratio or the window"
            )


def _recent_mask(valid: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``[B, N]`` bool: the last ``counts[b]`` columns of each (left-padded) row."""
    length = valid.shape[-1]
    start = torch.tensor([length - c for c in counts], device=valid.device)
    return (torch.arange(length, device=valid.device)[None, :] >= start[:, None]) & valid
